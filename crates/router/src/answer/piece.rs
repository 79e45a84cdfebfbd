//! The pieces a choice's text is read into: the one vocabulary every renderer speaks.

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
    /// The model's thinking (only for a model whose template thinks).
    Reasoning(String),
    Content(String),
    /// A complete call, parsed whole.
    Call(ParsedCall),
    /// A streamed call begins: its arguments follow as [`Piece::Arguments`], then
    /// [`Piece::CallEnded`].
    CallStarted {
        name: String,
    },
    /// The next fragment of the streaming call's arguments (compact JSON text).
    Arguments(String),
    CallEnded,
}
