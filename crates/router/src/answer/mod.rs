//! What a choice's text becomes, whatever protocol renders it: reasoning, answer text and tool
//! calls, as [`Piece`]s in the order the model wrote them. Thinking is split off first, so a
//! call is read only from the answer (a call the model muses about while thinking is not made),
//! and the tool parser never sees a think tag. Every renderer, streamed or whole, reads the same
//! pieces from the same parser, so the protocols cannot disagree about what the model said.

pub mod piece;
pub mod thinking;

pub use piece::{ParsedCall, Piece};
pub use thinking::{Start, Thinking, ThinkingSplitter};

use crate::tools::{CallParsing, ToolCallParser};

/// How one request's answers are read.
#[derive(Debug, Clone, Default)]
pub struct AnswerShape {
    /// For a thinking model on a chat endpoint: where each answer starts.
    pub thinking: Option<Start>,
    /// With active tools: how calls are read out of the answer.
    pub calls: Option<CallParsing>,
}

impl AnswerShape {
    pub fn parser(&self) -> AnswerParser {
        AnswerParser {
            thinking: self.thinking.map(ThinkingSplitter::new),
            calls: self.calls.as_ref().map(CallParsing::parser),
            reasoning_tokens: 0,
        }
    }
}

/// Reads one choice's text as it streams.
pub struct AnswerParser {
    thinking: Option<ThinkingSplitter>,
    calls: Option<ToolCallParser>,
    reasoning_tokens: u32,
}

impl AnswerParser {
    /// The pieces that `text` (which took `tokens` tokens) completes. Taken by value: a plain
    /// answer's text (no thinking, no tools) is passed on as it came, not copied per token.
    pub fn push(&mut self, text: String, tokens: u32) -> Vec<Piece> {
        let Some(splitter) = &mut self.thinking else {
            return match &mut self.calls {
                Some(calls) => calls.push(&text),
                None => vec![Piece::Content(text)],
            };
        };
        let was_thinking = splitter.thinking();
        let split = splitter.push(&text);
        self.reasoning_tokens += reasoning_share(tokens, was_thinking, splitter.thinking(), &split);
        self.answer(split)
    }

    /// The pieces held back for more text, at the end of it.
    pub fn finish(&mut self) -> Vec<Piece> {
        let split = self.thinking.as_mut().map(ThinkingSplitter::finish).unwrap_or_default();
        let mut pieces = self.answer(split);
        if let Some(calls) = &mut self.calls {
            pieces.extend(calls.finish());
        }
        pieces
    }

    /// The tokens spent thinking so far. A chunk whose text crosses `</think>` is shared by
    /// its bytes either side (a worker may send several tokens as one text).
    pub fn reasoning_tokens(&self) -> u32 {
        self.reasoning_tokens
    }

    /// Answer text through the call parser, when there is one; reasoning passes by it.
    fn answer(&mut self, split: Vec<Piece>) -> Vec<Piece> {
        let Some(calls) = &mut self.calls else { return split };
        let mut out = Vec::with_capacity(split.len());
        for piece in split {
            match piece {
                Piece::Content(text) => out.extend(calls.push(&text)),
                other => out.push(other),
            }
        }
        out
    }
}

/// How many of a chunk's `tokens` were thinking, from the state before and after it and the
/// bytes of its reasoning and answer text.
fn reasoning_share(tokens: u32, was_thinking: bool, is_thinking: bool, split: &[Piece]) -> u32 {
    let bytes = |reasoning: bool| -> usize {
        split
            .iter()
            .map(|p| match p {
                Piece::Reasoning(t) if reasoning => t.len(),
                Piece::Content(t) if !reasoning => t.len(),
                _ => 0,
            })
            .sum()
    };
    let (thought, answered) = (bytes(true), bytes(false));
    match (was_thinking || is_thinking || thought > 0, answered) {
        (false, _) => 0,
        (true, 0) => tokens,
        // The close tag is a token of the reasoning.
        (true, answered) => {
            let thought = thought + "</think>".len();
            ((u64::from(tokens) * thought as u64).div_ceil((thought + answered) as u64)) as u32
        }
    }
}

/// A whole answer, gathered from its pieces.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Gathered {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

impl Gathered {
    pub fn add(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Reasoning(t) => self.reasoning.push_str(&t),
                Piece::Content(t) => self.content.push_str(&t),
                Piece::Call(c) => self.calls.push(c),
                Piece::CallStarted { name } => self.calls.push(ParsedCall { name, arguments: String::new() }),
                Piece::Arguments(fragment) => {
                    self.calls.last_mut().expect("a call started").arguments.push_str(&fragment)
                }
                Piece::CallEnded => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::tools::Family;

    fn gather(shape: &AnswerShape, chunks: &[(&str, u32)]) -> (Gathered, u32) {
        let mut parser = shape.parser();
        let mut whole = Gathered::default();
        for (text, tokens) in chunks {
            whole.add(parser.push(text.to_string(), *tokens));
        }
        whole.add(parser.finish());
        (whole, parser.reasoning_tokens())
    }

    fn hermes_tools() -> CallParsing {
        CallParsing { family: Family::Hermes, parallel: true, names: Arc::new(vec!["get_weather".to_string()]) }
    }

    #[test]
    fn a_call_written_while_thinking_is_reasoning_and_one_in_the_answer_is_a_call() {
        let shape = AnswerShape { thinking: Some(Start::Thinking), calls: Some(hermes_tools()) };
        let musing = r#"maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>"#;
        let call = r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>"#;
        let (whole, _) = gather(&shape, &[(musing, 20), ("</think>\n\n", 2), (call, 20)]);
        assert_eq!(whole.reasoning, musing);
        assert_eq!(whole.content, "");
        assert_eq!(
            whole.calls,
            vec![ParsedCall { name: "get_weather".into(), arguments: r#"{"city":"Oslo"}"#.into() }]
        );
    }

    #[test]
    fn reasoning_tokens_count_the_chunks_spent_thinking_and_a_share_of_the_one_that_ends_it() {
        let shape = AnswerShape { thinking: Some(Start::Thinking), calls: None };
        let (whole, thought) = gather(&shape, &[("abc", 3), ("def", 3), ("</think>", 1), ("Yes.", 2)]);
        assert_eq!((whole.reasoning.as_str(), whole.content.as_str(), thought), ("abcdef", "Yes.", 7));
        // One chunk of 10 tokens: 8 bytes of thought and its 8-byte tag against 16 of answer.
        let (_, thought) = gather(&shape, &[("12345678</think>abcdefghijklmnop", 10)]);
        assert_eq!(thought, 5);
        let plain = AnswerShape::default();
        assert_eq!(gather(&plain, &[("<think>x</think>y", 5)]).1, 0, "a model that does not think");
        let (whole, _) = gather(&plain, &[("<think>x</think>y", 5)]);
        assert_eq!(whole.content, "<think>x</think>y", "its text is left as it is");
    }
}
