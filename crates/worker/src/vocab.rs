//! What the scheduler needs of a tokenizer: each token's output bytes and the end-of-sequence ids.
//! A trait, so the simulated engine can stream text without a real vocabulary.

use crate::tokenizer::ModelTokenizer;

pub trait Vocab: Send + Sync {
    /// Bytes the token adds to the output text (empty for control tokens).
    fn token_bytes(&self, id: u32) -> &[u8];
    /// A control token's spelling (`[TOOL_CALLS]`), for a request that keeps them; empty for any
    /// other token.
    fn special_text(&self, _id: u32) -> &[u8] {
        &[]
    }
    fn eos_ids(&self) -> &[u32];
}

impl Vocab for ModelTokenizer {
    fn token_bytes(&self, id: u32) -> &[u8] {
        ModelTokenizer::token_bytes(self, id)
    }

    fn special_text(&self, id: u32) -> &[u8] {
        ModelTokenizer::special_text(self, id)
    }

    fn eos_ids(&self) -> &[u32] {
        ModelTokenizer::eos_ids(self)
    }
}
