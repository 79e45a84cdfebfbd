//! Thinking kept apart from the answer, for models whose chat template thinks (DeepSeek-R1 and
//! its distills, Qwen3): the text between `<think>` and `</think>` is reasoning, the rest is the
//! answer, and neither tag reaches the client.
//!
//! Where thinking starts is decided by the prompt and the template, not guessed from the output:
//! - a template that opens `<think>` itself (R1's later one, Qwen3-Thinking's) leaves the prompt's
//!   last tag an opening one, so the answer starts inside thinking and only `</think>` ends it;
//! - a template that strips thinking from past turns but never writes `<think>` (R1's first one)
//!   is a model that always thinks and may leave out the opening tag: the same;
//! - otherwise (Qwen3, its thinking on, or closed by `enable_thinking: false`) the answer starts
//!   outside, where a leading `<think>` opens it.
//!
//! So R1's thinking is never taken for answer text, and a non-thinking Qwen3 answer is never
//! taken for reasoning (the two mistakes one rule for both families makes). Tags split across
//! chunks are held until they are whole.

use super::piece::Piece;
use crate::tokenize::PromptTokenizer;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// A model whose template thinks: its tags are single tokens of its vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thinking {
    open: u32,
    close: u32,
    /// The template never opens thinking, yet knows its end: the model always thinks first.
    always: bool,
}

/// Where an answer starts. Either way a leading `<think>` is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Inside thinking: only `</think>` ends it.
    Thinking,
    /// Outside thinking: a leading `<think>` opens it.
    Answer,
}

impl Thinking {
    /// The model's thinking tags, when its chat template writes them and its vocabulary has
    /// each as one token.
    pub fn of(tokenizer: &PromptTokenizer) -> Option<Thinking> {
        let source = tokenizer.template()?.source();
        if !source.contains(CLOSE) {
            return None;
        }
        let always = !source.contains(OPEN);
        Some(Thinking { open: tokenizer.token_id(OPEN)?, close: tokenizer.token_id(CLOSE)?, always })
    }

    /// Where the answer to `prompt` starts: inside thinking when the prompt's last tag opens it,
    /// or when the model always thinks and the prompt did not close it.
    pub fn start(&self, prompt: &[u32]) -> Start {
        match prompt.iter().rev().find(|&&t| t == self.open || t == self.close) {
            Some(&t) if t == self.open => Start::Thinking,
            None if self.always => Start::Thinking,
            _ => Start::Answer,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: a `<think>` may come (and opens thinking), and other text is
    /// thinking or answer as `thinking` says.
    Before { thinking: bool },
    /// Inside thinking; `started` once its first non-whitespace was sent.
    Thinking { started: bool },
    /// The answer; `started` likewise.
    Answer { started: bool },
}

/// Splits one choice's text, as it streams, into [`Piece::Reasoning`] and [`Piece::Content`].
/// Each part's leading whitespace (the newlines templates and models put after a tag) is dropped.
#[derive(Debug, Clone)]
pub struct ThinkingSplitter {
    state: State,
    /// Text that may be the start of a tag: sent once it is known not to be.
    held: String,
}

impl ThinkingSplitter {
    pub fn new(start: Start) -> Self {
        let state = State::Before { thinking: start == Start::Thinking };
        ThinkingSplitter { state, held: String::new() }
    }

    /// Inside thinking now (so the tokens being generated are reasoning tokens).
    pub fn thinking(&self) -> bool {
        matches!(self.state, State::Thinking { .. } | State::Before { thinking: true })
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut buffer = std::mem::take(&mut self.held);
        buffer.push_str(text);
        let mut out = Vec::new();
        let mut rest = buffer.as_str();
        loop {
            match self.state {
                State::Before { thinking } => {
                    let trimmed = rest.trim_start();
                    if let Some(after) = trimmed.strip_prefix(OPEN) {
                        self.state = State::Thinking { started: false };
                        rest = after;
                    } else if OPEN.starts_with(trimmed) {
                        // Whitespace, or the start of `<think>`: wait for more.
                        self.held = rest.to_string();
                        return out;
                    } else if thinking {
                        self.state = State::Thinking { started: false };
                    } else {
                        self.state = State::Answer { started: false };
                    }
                }
                State::Thinking { ref mut started } => match rest.find(CLOSE) {
                    Some(end) => {
                        send(&mut out, started, &rest[..end], Piece::Reasoning);
                        self.state = State::Answer { started: false };
                        rest = &rest[end + CLOSE.len()..];
                    }
                    None => {
                        let keep = partial_tag_len(rest, CLOSE);
                        send(&mut out, started, &rest[..rest.len() - keep], Piece::Reasoning);
                        self.held = rest[rest.len() - keep..].to_string();
                        return out;
                    }
                },
                State::Answer { ref mut started } => {
                    send(&mut out, started, rest, Piece::Content);
                    return out;
                }
            }
        }
    }

    /// The end of the text: what was held is what it seemed to start.
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match &mut self.state {
            State::Before { thinking } => {
                let piece = if *thinking { Piece::Reasoning } else { Piece::Content };
                send(&mut out, &mut false, &held, piece);
            }
            State::Thinking { started } => send(&mut out, started, &held, Piece::Reasoning),
            State::Answer { started } => send(&mut out, started, &held, Piece::Content),
        }
        out
    }
}

/// Sends `text` as a piece of its part, its leading whitespace dropped until the part starts.
fn send(out: &mut Vec<Piece>, started: &mut bool, text: &str, piece: fn(String) -> Piece) {
    let text = if *started { text } else { text.trim_start() };
    if !text.is_empty() {
        *started = true;
        out.push(piece(text.to_string()));
    }
}

/// The length of the longest end of `text` that begins `tag` (and might become it).
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reasoning and the answer, joined from what the splitter sends for `chunks`.
    fn split(start: Start, chunks: &[&str]) -> (String, String) {
        let mut s = ThinkingSplitter::new(start);
        let mut pieces: Vec<Piece> = chunks.iter().flat_map(|c| s.push(c)).collect();
        pieces.extend(s.finish());
        let (mut reasoning, mut answer) = (String::new(), String::new());
        for p in pieces {
            match p {
                Piece::Reasoning(t) => reasoning.push_str(&t),
                Piece::Content(t) => answer.push_str(&t),
                other => panic!("the splitter sent {other:?}"),
            }
        }
        (reasoning, answer)
    }

    #[test]
    fn an_answer_the_prompt_opened_thinking_for_is_reasoning_until_the_close_tag() {
        let (r, a) = split(Start::Thinking, &["Two and two", " make four.\n</think>\n\nFour."]);
        assert_eq!((r.as_str(), a.as_str()), ("Two and two make four.\n", "Four."));
    }

    #[test]
    fn a_tag_split_across_chunks_is_found_and_never_sent() {
        let (r, a) = split(Start::Thinking, &["hmm </", "thi", "nk>", " yes"]);
        assert_eq!((r.as_str(), a.as_str()), ("hmm ", "yes"));
        let (r, a) = split(Start::Answer, &["\n<th", "ink>\nok", "</think>done"]);
        assert_eq!((r.as_str(), a.as_str()), ("ok", "done"));
    }

    #[test]
    fn an_answer_outside_thinking_is_all_answer_even_when_it_mentions_a_tag_later() {
        let (r, a) = split(Start::Answer, &["Use <think> tags", " and </think>."]);
        assert_eq!((r.as_str(), a.as_str()), ("", "Use <think> tags and </think>."));
    }

    #[test]
    fn text_cut_off_inside_thinking_stays_reasoning_with_its_half_tag() {
        let (r, a) = split(Start::Thinking, &["still going </thi"]);
        assert_eq!((r.as_str(), a.as_str()), ("still going </thi", ""));
        let (r, a) = split(Start::Answer, &["<thi"]);
        assert_eq!((r.as_str(), a.as_str()), ("", "<thi"), "a half open tag that never opened is answer text");
    }

    #[test]
    fn non_ascii_before_a_partial_tag_is_cut_on_a_character_boundary() {
        let (r, a) = split(Start::Thinking, &["é€<", "/think>ü"]);
        assert_eq!((r.as_str(), a.as_str()), ("é€", "ü"));
    }

    #[test]
    fn the_prompts_last_tag_decides_where_the_answer_starts_and_a_model_that_always_thinks_starts_inside() {
        let t = Thinking { open: 7, close: 8, always: false };
        assert_eq!(t.start(&[1, 7, 2]), Start::Thinking);
        assert_eq!(t.start(&[1, 7, 2, 8, 3]), Start::Answer, "a closed think (thinking turned off)");
        assert_eq!(t.start(&[1, 2]), Start::Answer);
        let always = Thinking { always: true, ..t };
        assert_eq!(always.start(&[1, 2]), Start::Thinking);
        assert_eq!(always.start(&[1, 7, 8, 2]), Start::Answer);
    }

    #[test]
    fn an_answer_inside_thinking_may_still_write_the_opening_tag_and_it_is_dropped() {
        let (r, a) = split(Start::Thinking, &["<thi", "nk>\nplan", "</think>go"]);
        assert_eq!((r.as_str(), a.as_str()), ("plan", "go"));
        let (r, a) = split(Start::Thinking, &["no close tag"]);
        assert_eq!((r.as_str(), a.as_str()), ("no close tag", ""), "cut off while thinking");
    }
}
