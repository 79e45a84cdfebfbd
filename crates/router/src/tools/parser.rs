//! Tool calls out of a model's text, as it streams, per model family.
//!
//! The parser sees one continuous stream per choice (a migration does not restart it) and splits
//! it into content and complete calls. Invariant: tool markup never reaches content. Text that
//! could still be the start of a call marker is held back until it is known not to be; a call
//! still open when the stream ends (a truncated answer), or one whose body is not a valid call,
//! is dropped, never shown as text.

use std::sync::Arc;

use serde_json::Value;

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
}

/// One complete call, as the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as compact JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// What a piece of the stream turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    Call(ParsedCall),
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
                let Some(end) = self.buf.find(HERMES_CLOSE) else { return };
                let body: String = self.buf.drain(..end + HERMES_CLOSE.len()).collect();
                self.in_calls = false;
                match parse_call(&body[..end], "arguments") {
                    Some(call) => self.emit_call(call, out),
                    None => tracing::debug!(body = %body, "dropped a tool call that is not valid JSON"),
                }
            } else if let Some(start) = self.buf.find(HERMES_OPEN) {
                let before: String = self.buf.drain(..start + HERMES_OPEN.len()).collect();
                content(out, before[..start].trim_end_matches('\n'));
                self.in_calls = true;
            } else {
                self.release_content(&[HERMES_OPEN], out);
                return;
            }
        }
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

/// `{"name": ..., <args_key>: {...}}` (arguments may also be given as JSON text).
fn parse_call(body: &str, args_key: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    call_of(&v, args_key)
}

fn call_of(v: &Value, args_key: &str) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get(args_key).or_else(|| v.get("arguments")).or_else(|| v.get("parameters"));
    let arguments = match args {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok()?.to_string(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

/// Llama 3's calls: JSON objects separated by `;` (a `;` inside a string is the string's), every
/// one a call; `None` if any is not.
fn llama3_calls(body: &str) -> Option<Vec<ParsedCall>> {
    let mut rest = body.trim_start();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = values.next()?.ok()?;
        calls.push(call_of(&v, "parameters")?);
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
    match serde_json::from_str::<Value>(body.trim()) {
        Ok(Value::Array(calls)) => calls.iter().filter_map(|c| call_of(c, "arguments")).collect(),
        Ok(single @ Value::Object(_)) => call_of(&single, "arguments").into_iter().collect(),
        _ => Vec::new(),
    }
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
        for piece in pieces {
            match piece {
                Piece::Content(t) => text += &t,
                Piece::Call(c) => calls.push(c),
            }
        }
        (text, calls)
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
    fn the_family_follows_the_chat_template() {
        assert_eq!(Family::of_template(Some("{{ '[TOOL_CALLS]' }}")), Family::Mistral);
        assert_eq!(Family::of_template(Some("<|python_tag|>")), Family::Llama3Json);
        assert_eq!(Family::of_template(Some("<tool_call>")), Family::Hermes);
        assert_eq!(Family::of_template(None), Family::Hermes);
    }
}
