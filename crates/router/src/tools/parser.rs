//! Tool calls out of a model's text, as it streams, per model family.
//!
//! The parser sees one continuous stream per choice (a migration does not restart it) and splits
//! it into content and calls. Invariant: tool markup never reaches content. Text that could
//! still be the start of a call marker is held back until it is known not to be.
//!
//! A tagged Hermes call whose body opens `{"name": ..., "arguments": {` streams: its name as soon
//! as it is known, then its arguments as they are generated, compacted (the whitespace between
//! JSON tokens dropped, strings verbatim), as OpenAI and Anthropic stream them. Every other call
//! (another key order, the other families' formats, a bare call) is held and parsed whole. Both
//! give the same arguments text for the same output: the whole path compacts the model's raw
//! text the same way, so a client that joins the fragments gets exactly the non-streamed call.
//! Once a call streams it is committed: cut off by the end of the stream, it ends as far as it
//! got (the finish reason says why). A held call still open at the end, or whose body is not a
//! valid call, is dropped, never shown as text.

use std::sync::Arc;

use serde_json::value::RawValue;

pub use crate::answer::piece::ParsedCall;
use crate::answer::piece::Piece;

/// How a model family writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    /// one block per call. Also Bellows' own tool prompt for templates without tool support.
    /// An answer that is only `{"name": <a declared function>, "arguments": {...}}`, no tags, is
    /// a call too: small instruct models write their calls so (as vLLM's Qwen parsers accept).
    Hermes,
    /// Llama 3.x: `{"name": ..., "parameters": {...}}` objects separated by `;`, as the whole
    /// answer (from its first character), or after a `<|python_tag|>`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.
    Mistral,
}

impl Family {
    /// The family a chat template writes calls for; Hermes for a template with no tool format
    /// of its own (Bellows then renders the tools in Hermes' format itself).
    pub fn of_template(template: Option<&str>) -> Family {
        match template {
            Some(t) if t.contains("[TOOL_CALLS]") => Family::Mistral,
            Some(t) if t.contains("<|python_tag|>") || t.contains("<|eom_id|>") => Family::Llama3Json,
            _ => Family::Hermes,
        }
    }

    /// Its calls start with a control token (`[TOOL_CALLS]`, `<|python_tag|>`) that a worker
    /// prints as nothing unless the request keeps control tokens: without them, auto mode would
    /// never see a call start.
    pub fn opens_with_a_control_token(self) -> bool {
        matches!(self, Family::Mistral | Family::Llama3Json)
    }
}

/// Where the parser is inside a tagged Hermes call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallState {
    /// Reading the body's head, to see whether it can stream.
    Head,
    /// Streaming: the arguments' text from byte `at` of the buffer on is not yet sent.
    Streaming { at: usize, args: Compactor },
    /// Held until the closing tag, then parsed whole.
    Whole,
}

/// A streaming parser for one choice.
pub struct ToolCallParser {
    family: Family,
    /// Text not yet classified.
    buf: String,
    /// Inside a call (Hermes), or past the start marker (Mistral, Llama 3): the rest is calls.
    in_calls: bool,
    /// Calls after the first are dropped (`parallel_tool_calls: false`).
    parallel: bool,
    calls: usize,
    /// The answer's first character has been seen (a bare call can only begin there).
    started: bool,
    /// The answer began as bare JSON, with no marker: held whole, it is calls only if it parses
    /// as them, and content otherwise.
    bare: bool,
    /// The functions the request declared (a bare Hermes call must name one).
    names: Arc<Vec<String>>,
    call: CallState,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolCallParser {
    pub fn new(family: Family, parallel: bool, names: Arc<Vec<String>>) -> Self {
        ToolCallParser {
            family,
            buf: String::new(),
            in_calls: false,
            parallel,
            calls: 0,
            started: false,
            bare: false,
            names,
            call: CallState::Head,
        }
    }

    /// Feed the next text of the stream; returns what is now known.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        match self.family {
            Family::Hermes => self.hermes(&mut out),
            Family::Mistral => self.leading_marker(&[MISTRAL_OPEN], &mut out),
            Family::Llama3Json => self.llama3(&mut out),
        }
        out
    }

    /// The stream ended: held-back text that never became a marker is content; an open call is
    /// dropped (for Mistral and Llama 3, the calls are parsed now, whole).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.family == Family::Hermes && self.bare {
            let body = std::mem::take(&mut self.buf);
            match parse_call(&body, "arguments").filter(|c| self.names.contains(&c.name)) {
                Some(call) => {
                    self.emit_call(call, &mut out);
                    return out;
                }
                // Not a call after all: the held answer goes through as any other would.
                None => {
                    (self.bare, self.started, self.buf) = (false, true, body);
                    self.hermes(&mut out);
                }
            }
        }
        let rest = std::mem::take(&mut self.buf);
        if !self.in_calls {
            // Whitespace after the last call belongs to no one.
            if !(rest.trim().is_empty() && self.calls > 0) {
                content(&mut out, &rest);
            }
            return out;
        }
        let calls = match self.family {
            Family::Hermes if matches!(self.call, CallState::Streaming { .. }) => {
                out.push(Piece::CallEnded); // committed: ends as far as it got
                return out;
            }
            Family::Hermes => Vec::new(), // unterminated: truncated output
            Family::Mistral => parse_array(&rest),
            Family::Llama3Json => match llama3_calls(&rest) {
                Some(calls) => calls,
                None if self.bare => {
                    content(&mut out, rest.trim());
                    return out;
                }
                None => Vec::new(),
            },
        };
        for c in calls {
            self.emit_call(c, &mut out);
        }
        out
    }

    fn emit_call(&mut self, call: ParsedCall, out: &mut Vec<Piece>) {
        if self.parallel || self.calls == 0 {
            self.calls += 1;
            out.push(Piece::Call(call));
        }
    }

    fn hermes(&mut self, out: &mut Vec<Piece>) {
        if !self.started {
            let t = self.buf.trim_start();
            if t.is_empty() {
                return;
            }
            if t.starts_with('{') && !self.names.is_empty() {
                self.bare = true;
            }
            self.started = true;
        }
        if self.bare {
            return;
        }
        loop {
            if self.in_calls {
                if !self.hermes_call(out) {
                    return;
                }
            } else if let Some(start) = self.buf.find(HERMES_OPEN) {
                let before: String = self.buf.drain(..start + HERMES_OPEN.len()).collect();
                content(out, before[..start].trim_end_matches('\n'));
                (self.in_calls, self.call) = (true, CallState::Head);
            } else {
                self.release_content(&[HERMES_OPEN], out);
                return;
            }
        }
    }

    /// One step inside a tagged call; true once the call is closed (the buffer then holds what
    /// follows its closing tag).
    fn hermes_call(&mut self, out: &mut Vec<Piece>) -> bool {
        if self.call == CallState::Head {
            match call_head(&self.buf) {
                Err(Stop::Incomplete) => return false,
                Ok((name, at)) if self.parallel || self.calls == 0 => {
                    self.calls += 1;
                    out.push(Piece::CallStarted { name });
                    self.call = CallState::Streaming { at, args: Compactor::default() };
                }
                // Another layout, or a call that is dropped anyway: parsed whole at its close.
                Ok(_) | Err(Stop::Mismatch) => self.call = CallState::Whole,
            }
        }
        let search_from = match &mut self.call {
            CallState::Streaming { at, args } => {
                if !args.done {
                    let mut fragment = String::new();
                    *at += args.feed(&self.buf[*at..], &mut fragment);
                    if !fragment.is_empty() {
                        out.push(Piece::Arguments(fragment));
                    }
                    if !args.done {
                        return false;
                    }
                }
                *at
            }
            _ => 0,
        };
        let Some(end) = self.buf[search_from..].find(HERMES_CLOSE).map(|e| e + search_from) else { return false };
        let body: String = self.buf.drain(..end + HERMES_CLOSE.len()).collect();
        self.in_calls = false;
        match std::mem::replace(&mut self.call, CallState::Head) {
            CallState::Streaming { .. } => out.push(Piece::CallEnded),
            _ => match parse_call(&body[..end], "arguments") {
                Some(call) => self.emit_call(call, out),
                None => tracing::debug!(body = %body, "dropped a tool call that is not valid JSON"),
            },
        }
        true
    }

    /// Llama 3: an answer that opens with `{` may be calls (held whole, parsed at the end);
    /// otherwise only a `<|python_tag|>` begins them.
    fn llama3(&mut self, out: &mut Vec<Piece>) {
        if self.in_calls {
            return;
        }
        if !self.started {
            let t = self.buf.trim_start();
            if t.is_empty() || (t.len() < PYTHON_TAG.len() && PYTHON_TAG.starts_with(t)) {
                return;
            }
            if t.starts_with('{') {
                (self.in_calls, self.bare) = (true, true);
                return;
            }
            self.started = true;
        }
        self.leading_marker(&[PYTHON_TAG], out);
    }

    /// Families whose calls take the rest of the answer once a marker begins it.
    fn leading_marker(&mut self, markers: &[&str], out: &mut Vec<Piece>) {
        if self.in_calls {
            return;
        }
        if let Some(start) = markers.iter().filter_map(|m| self.buf.find(m).map(|i| (i, m))).min() {
            let (i, marker) = start;
            let before: String = self.buf.drain(..i).collect();
            content(out, before.trim_end());
            if *marker == MISTRAL_OPEN || *marker == PYTHON_TAG {
                self.buf.drain(..marker.len());
            }
            self.in_calls = true;
            return;
        }
        self.release_content(markers, out);
    }

    /// Send as content what can no longer begin a call: all but a possible start of a marker
    /// and the whitespace before it (which goes with the call if one begins there).
    fn release_content(&mut self, markers: &[&str], out: &mut Vec<Piece>) {
        let split = self.buf.len() - held_prefix(&self.buf, markers);
        let ready: String = self.buf.drain(..self.buf[..split].trim_end().len()).collect();
        content(out, &ready);
    }
}

fn content(out: &mut Vec<Piece>, text: &str) {
    if !text.is_empty() {
        out.push(Piece::Content(text.to_string()));
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of a marker.
fn held_prefix(text: &str, markers: &[&str]) -> usize {
    markers.iter().flat_map(|m| (1..m.len()).rev().filter(|&n| text.ends_with(&m[..n]))).max().unwrap_or(0)
}

/// A call as the model wrote it, its arguments still the model's own text: re-serializing a
/// parsed value would reformat (or reorder) what the streaming path sends verbatim.
#[derive(serde::Deserialize)]
struct RawCall<'a> {
    name: String,
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
}

impl RawCall<'_> {
    /// The call, its arguments compacted; `args_key` is looked at first. Arguments given as
    /// JSON text in a string are that text's object.
    fn call(&self, args_key: &str) -> Option<ParsedCall> {
        let (first, second) = match args_key {
            "parameters" => (self.parameters, self.arguments),
            _ => (self.arguments, self.parameters),
        };
        let raw = first.or(second).map_or("null", RawValue::get);
        let arguments = match raw.as_bytes().first() {
            Some(b'{') => compact(raw),
            Some(b'"') => {
                let text: String = serde_json::from_str(raw).ok()?;
                let inner: &RawValue = serde_json::from_str(&text).ok()?;
                inner.get().starts_with('{').then(|| compact(inner.get()))?
            }
            _ if raw == "null" => "{}".to_string(),
            _ => return None,
        };
        Some(ParsedCall { name: self.name.clone(), arguments })
    }
}

/// `{"name": ..., <args_key>: {...}}` (arguments may also be given as JSON text).
fn parse_call(body: &str, args_key: &str) -> Option<ParsedCall> {
    serde_json::from_str::<RawCall>(body.trim()).ok()?.call(args_key)
}

/// Llama 3's calls: JSON objects separated by `;` (a `;` inside a string is the string's), every
/// one a call; `None` if any is not.
fn llama3_calls(body: &str) -> Option<Vec<ParsedCall>> {
    let mut rest = body.trim_start();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<RawCall>();
        let raw = values.next()?.ok()?;
        calls.push(raw.call("parameters")?);
        rest = rest[values.byte_offset()..].trim_start();
        if let Some(after) = rest.strip_prefix(';') {
            rest = after.trim_start();
        } else if !rest.is_empty() {
            return None;
        }
    }
    (!calls.is_empty()).then_some(calls)
}

fn parse_array(body: &str) -> Vec<ParsedCall> {
    let body = body.trim();
    if body.starts_with('[') {
        let calls: Vec<RawCall> = serde_json::from_str(body).unwrap_or_default();
        return calls.iter().filter_map(|c| c.call("arguments")).collect();
    }
    parse_call(body, "arguments").into_iter().collect()
}

/// Why a call body's head was not read.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// The text so far could still be such a head.
    Incomplete,
    /// It is not one (another key order, or not JSON).
    Mismatch,
}

/// The call's name and the byte at which its arguments' `{` is, if `body` opens with the head
/// `{"name": <string>, "arguments": `.
fn call_head(body: &str) -> Result<(String, usize), Stop> {
    let mut c = Cursor { s: body, i: 0 };
    c.literal("{")?;
    c.literal("\"name\"")?;
    c.literal(":")?;
    let name = c.string()?;
    c.literal(",")?;
    c.literal("\"arguments\"")?;
    c.literal(":")?;
    c.skip_space();
    match body[c.i..].chars().next() {
        None => Err(Stop::Incomplete),
        Some('{') => Ok((name, c.i)),
        Some(_) => Err(Stop::Mismatch),
    }
}

struct Cursor<'a> {
    s: &'a str,
    i: usize,
}

impl Cursor<'_> {
    fn skip_space(&mut self) {
        let rest = &self.s[self.i..];
        self.i += rest.len() - rest.trim_start_matches([' ', '\t', '\n', '\r']).len();
    }

    /// Whitespace, then `token`.
    fn literal(&mut self, token: &str) -> Result<(), Stop> {
        self.skip_space();
        let rest = &self.s[self.i..];
        if rest.starts_with(token) {
            self.i += token.len();
            Ok(())
        } else if token.starts_with(rest) {
            Err(Stop::Incomplete)
        } else {
            Err(Stop::Mismatch)
        }
    }

    /// Whitespace, then a JSON string, decoded.
    fn string(&mut self) -> Result<String, Stop> {
        self.literal("\"")?;
        let start = self.i - 1;
        let mut escaped = false;
        for (k, ch) in self.s[self.i..].char_indices() {
            match ch {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    self.i += k + 1;
                    return serde_json::from_str(&self.s[start..self.i]).map_err(|_| Stop::Mismatch);
                }
                _ => {}
            }
        }
        Err(Stop::Incomplete)
    }
}

/// Follows one JSON value's text as it arrives and writes it compacted: the whitespace between
/// tokens dropped, strings verbatim. The value must be well formed for `done` to mean its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Compactor {
    depth: usize,
    in_string: bool,
    escaped: bool,
    done: bool,
}

impl Compactor {
    /// Compact the value's next text into `out`; the bytes taken (all of `text`, or up to the
    /// value's end).
    fn feed(&mut self, text: &str, out: &mut String) -> usize {
        for (i, ch) in text.char_indices() {
            if self.in_string {
                out.push(ch);
                match ch {
                    _ if self.escaped => self.escaped = false,
                    '\\' => self.escaped = true,
                    '"' => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match ch {
                ' ' | '\t' | '\n' | '\r' => continue,
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' => self.depth = self.depth.saturating_sub(1),
                _ => {}
            }
            out.push(ch);
            if self.depth == 0 && matches!(ch, '}' | ']') {
                self.done = true;
                return i + 1;
            }
        }
        text.len()
    }
}

/// `raw`, one JSON value, compacted as a streamed call's arguments are.
fn compact(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    Compactor::default().feed(raw, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(family: Family, parallel: bool, chunks: &[&str]) -> (String, Vec<ParsedCall>) {
        let names = ["a", "b", "weather", "time"].map(String::from).to_vec();
        let mut p = ToolCallParser::new(family, parallel, Arc::new(names));
        let mut pieces: Vec<Piece> = chunks.iter().flat_map(|c| p.push(c)).collect();
        pieces.extend(p.finish());
        let mut text = String::new();
        let mut calls = Vec::new();
        let mut open = false;
        for piece in pieces {
            match piece {
                Piece::Content(t) => text += &t,
                Piece::Call(c) => calls.push(c),
                Piece::CallStarted { name } => {
                    assert!(!open, "a call starts only after the last one ended");
                    open = true;
                    calls.push(ParsedCall { name, arguments: String::new() });
                }
                Piece::Arguments(a) => {
                    assert!(open, "arguments belong to an open call");
                    calls.last_mut().unwrap().arguments += &a;
                }
                Piece::CallEnded => {
                    assert!(open, "only an open call ends");
                    open = false;
                }
                Piece::Reasoning(_) => panic!("the call parser sent reasoning"),
            }
        }
        assert!(!open, "every streamed call ends");
        (text, calls)
    }

    fn chunked(text: &str, size: usize) -> Vec<String> {
        text.chars().collect::<Vec<_>>().chunks(size).map(|c| c.iter().collect()).collect()
    }

    /// Tricky argument values: what a hand-written splitter or a re-serializer gets wrong.
    fn awkward_arguments() -> Vec<String> {
        let strings = [
            "a; b",
            "close } and ] early",
            r#"she said \"hi\""#,
            r"back\\slash and \/ slash",
            r"\u00e9t\u00e9 \ud83d\ude00",
            "déjà vu — 東京 🚀",
            r"tab\tnew\nline",
            "</tool_call> inside",
            "",
        ];
        let mut out: Vec<String> = strings
            .iter()
            .map(|s| format!(r#"{{ "q": "{s}", "n" : [1, 2.50, -3e2, true, null], "o": {{"k": {{}} }} }}"#))
            .collect();
        out.push("{}".into());
        out.push("{\n  \"nested\": {\"deep\": [[], [{}]]}\n}".into());
        out
    }

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_calls_split_across_any_chunks_come_out_whole_with_no_markup_in_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let want = vec![call("weather", r#"{"city":"Paris"}"#), call("time", "{}")];
        for size in [1, 2, 3, 5, 7, 11, text.len()] {
            let chunks: Vec<String> =
                text.chars().collect::<Vec<_>>().chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
            let (content, calls) = run(Family::Hermes, true, &refs);
            assert_eq!(content, "Let me check.", "chunks of {size}");
            assert_eq!(calls, want, "chunks of {size}");
        }
    }

    #[test]
    fn a_truncated_call_is_dropped_and_a_near_marker_is_content() {
        let (content, calls) = run(Family::Hermes, true, &["ok <tool_call>\n{\"name\": \"weath"]);
        assert_eq!((content.as_str(), calls.len()), ("ok ", 0));
        let (content, calls) = run(Family::Hermes, true, &["a <tool_", "b> c <tool"]);
        assert_eq!((content.as_str(), calls.len()), ("a <tool_b> c <tool", 0));
    }

    #[test]
    fn without_parallel_calls_only_the_first_call_is_kept() {
        let both = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
        assert_eq!(run(Family::Hermes, false, &[both]).1, vec![call("a", "{}")]);
        assert_eq!(run(Family::Hermes, true, &[both]).1.len(), 2);
    }

    #[test]
    fn an_invalid_call_body_is_dropped_not_shown() {
        let (content, calls) = run(Family::Hermes, true, &["<tool_call>not json</tool_call>done"]);
        assert_eq!((content.as_str(), calls.len()), ("done", 0));
    }

    #[test]
    fn llama3_and_mistral_calls_parse_and_plain_answers_stay_content() {
        let (content, calls) = run(
            Family::Llama3Json,
            true,
            &["<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}"],
        );
        assert_eq!(content, "");
        assert_eq!(calls, vec![call("a", r#"{"x":1}"#), call("b", "{}")]);
        let (_, calls) = run(Family::Llama3Json, true, &["{\"name\": \"a\", ", "\"parameters\": {}}"]);
        assert_eq!(calls, vec![call("a", "{}")]);
        let (content, calls) =
            run(Family::Mistral, true, &["[TOOL_", "CALLS][{\"name\": \"a\", \"arguments\": {\"q\": \"x\"}}]"]);
        assert_eq!((content.as_str(), calls), ("", vec![call("a", r#"{"q":"x"}"#)]));
        assert_eq!(run(Family::Mistral, true, &["just text [TOOL"]).0, "just text [TOOL");
    }

    #[test]
    fn llama3_calls_split_on_semicolons_between_objects_only() {
        let text = r#"{"name": "a", "parameters": {"q": "x; y}"}}; { "name": "b", "parameters": {} }"#;
        for size in [1, 3, 7, text.len()] {
            let chunks: Vec<String> =
                text.chars().collect::<Vec<_>>().chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
            let (content, calls) = run(Family::Llama3Json, true, &refs);
            assert_eq!(content, "", "chunks of {size}");
            assert_eq!(calls, vec![call("a", r#"{"q":"x; y}"}"#), call("b", "{}")], "chunks of {size}");
        }
    }

    #[test]
    fn llama3_text_that_only_looks_like_a_call_stays_content() {
        let mid = r#"The call would be {"name": "a", "parameters": {}} if I made one."#;
        assert_eq!(run(Family::Llama3Json, true, &[mid]), (mid.to_string(), vec![]), "a call begins the answer");
        let json_answer = r#"{"answer": 42}"#;
        assert_eq!(run(Family::Llama3Json, true, &[json_answer]), (json_answer.to_string(), vec![]));
        let broken = r#"{"name": "a", "parameters": {}}; and some words"#;
        assert_eq!(run(Family::Llama3Json, true, &[broken]).0, broken, "not calls after all: shown, not dropped");
        let tagged = "<|python_tag|>not json";
        assert_eq!(run(Family::Llama3Json, true, &[tagged]), (String::new(), vec![]), "a marked body is never content");
    }

    #[test]
    fn a_bare_hermes_call_naming_a_declared_function_is_a_call_and_other_json_is_content() {
        let bare = r#"{"name": "weather", "arguments": {"city": "Paris"}}"#;
        for size in [1, 4, bare.len()] {
            let chunks: Vec<String> =
                bare.chars().collect::<Vec<_>>().chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
            assert_eq!(run(Family::Hermes, true, &refs), (String::new(), vec![call("weather", r#"{"city":"Paris"}"#)]));
        }
        let undeclared = r#"{"name": "launch", "arguments": {}}"#;
        assert_eq!(run(Family::Hermes, true, &[undeclared]).0, undeclared, "not a function of the request");
        let answer = r#"{"city": "Paris"} is the JSON."#;
        assert_eq!(run(Family::Hermes, true, &[answer]), (answer.to_string(), vec![]));
        let mid = r#"Call it as {"name": "weather", "arguments": {}} please."#;
        assert_eq!(run(Family::Hermes, true, &[mid]).0, mid, "only a whole answer is a bare call");
        let tagged_after = "{\"x\": 1}\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>";
        assert_eq!(run(Family::Hermes, true, &[tagged_after]), ("{\"x\": 1}".to_string(), vec![call("time", "{}")]));
    }

    #[test]
    fn a_tagged_call_streams_its_name_first_then_argument_fragments_as_they_arrive() {
        let names = Arc::new(vec!["weather".to_string()]);
        let mut p = ToolCallParser::new(Family::Hermes, true, names);
        assert_eq!(p.push("<tool_call>\n{\"name\": \"weath"), vec![]);
        assert_eq!(p.push("er\", \"arguments\": "), vec![], "the name is sent once its arguments open");
        assert_eq!(
            p.push("{\"city\": \"Pa"),
            vec![Piece::CallStarted { name: "weather".into() }, Piece::Arguments("{\"city\":\"Pa".into())]
        );
        assert_eq!(p.push("ris\"}"), vec![Piece::Arguments("ris\"}".into())]);
        assert_eq!(p.push("}\n</tool_call> after"), vec![Piece::CallEnded, Piece::Content(" after".into())]);
        assert_eq!(p.finish(), vec![]);
    }

    #[test]
    fn streamed_fragments_join_to_exactly_the_call_parsed_whole_for_awkward_arguments() {
        for args in awkward_arguments() {
            let streamed = format!("<tool_call>\n{{\"name\": \"a\", \"arguments\": {args}}}\n</tool_call>");
            let held = format!("<tool_call>\n{{\"arguments\": {args}, \"name\": \"a\"}}\n</tool_call>");
            let bare = format!("{{\"name\": \"a\", \"arguments\": {args}}}");
            let (content, whole) = run(Family::Hermes, true, &[&streamed]);
            assert_eq!((content.as_str(), whole.len()), ("", 1), "{args}");
            let source: serde_json::Value = serde_json::from_str(&args).unwrap();
            let parsed: serde_json::Value = serde_json::from_str(&whole[0].arguments).unwrap();
            assert_eq!(parsed, source, "the arguments keep their meaning: {args}");
            assert_eq!(compact(&whole[0].arguments), whole[0].arguments, "already compact");
            for size in [1, 2, 3, 7, 13] {
                let chunks = chunked(&streamed, size);
                let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
                assert_eq!(
                    run(Family::Hermes, true, &refs),
                    (String::new(), whole.clone()),
                    "{args} in chunks of {size}"
                );
            }
            // Held to its closing tag, a call cannot hold that tag in a string (as in vLLM's parser).
            if !args.contains(HERMES_CLOSE) {
                assert_eq!(run(Family::Hermes, true, &[&held]).1, whole, "held: {args}");
            }
            assert_eq!(run(Family::Hermes, true, &[&bare]).1, whole, "bare: {args}");
            let llama = bare.replace("\"arguments\"", "\"parameters\"");
            assert_eq!(run(Family::Llama3Json, true, &[&llama]).1, whole, "llama3: {args}");
            assert_eq!(run(Family::Mistral, true, &["[TOOL_CALLS][", &bare, "]"]).1, whole, "mistral: {args}");
        }
    }

    #[test]
    fn a_streamed_call_cut_off_ends_as_far_as_it_got_and_a_held_one_is_dropped() {
        let (content, calls) =
            run(Family::Hermes, true, &["<tool_call>{\"name\": \"a\", \"arguments\": {\"q\": \"hal"]);
        assert_eq!((content.as_str(), calls), ("", vec![call("a", "{\"q\":\"hal")]));
        let (content, calls) = run(Family::Hermes, true, &["<tool_call>{\"arguments\": {\"q\": 1}, \"name\": \"a\""]);
        assert_eq!((content.as_str(), calls.len()), ("", 0));
    }

    #[test]
    fn without_parallel_calls_a_second_streamable_call_is_dropped_unsent() {
        let two = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {\"x\": 1}}</tool_call>";
        let mut p = ToolCallParser::new(Family::Hermes, false, Arc::new(vec![]));
        let mut pieces = p.push(two);
        pieces.extend(p.finish());
        assert_eq!(
            pieces,
            vec![Piece::CallStarted { name: "a".into() }, Piece::Arguments("{}".into()), Piece::CallEnded]
        );
    }

    #[test]
    fn the_family_follows_the_chat_template() {
        assert_eq!(Family::of_template(Some("{{ '[TOOL_CALLS]' }}")), Family::Mistral);
        assert_eq!(Family::of_template(Some("<|python_tag|>")), Family::Llama3Json);
        assert_eq!(Family::of_template(Some("<tool_call>")), Family::Hermes);
        assert_eq!(Family::of_template(None), Family::Hermes);
        assert!(Family::Mistral.opens_with_a_control_token() && Family::Llama3Json.opens_with_a_control_token());
        assert!(!Family::Hermes.opens_with_a_control_token(), "Hermes' tags are text tokens");
    }
}
