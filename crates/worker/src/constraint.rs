//! Constrained decoding: a request's grammar, as a token mask applied before sampling.
//!
//! Each constrained request owns a [`Grammar`] (an llguidance matcher) that has consumed exactly
//! the tokens the request generated, so its mask depends only on the request's own output, never
//! on its batch neighbours: the engine's bit-exactness across batch shapes holds for constrained
//! rows too. The compiler's token table is built from the same [`Vocab`] bytes the detokenizer
//! streams, so a token the mask allows is one whose text the grammar accepts, byte for byte.
//!
//! The compiler is built on the first constrained request (a 49k-token vocabulary takes tens of
//! milliseconds), so a worker that never sees one pays nothing.

use std::sync::{Arc, OnceLock};

use bellows_common::constraint::{Constraint, ConstraintError, factory_for_vocab};
use llguidance::{Matcher, ParserFactory, toktrie::SimpleVob};

use crate::vocab::Vocab;

/// Compiles constraints for one model's vocabulary.
pub struct GrammarCompiler {
    vocab: Arc<dyn Vocab>,
    vocab_size: usize,
    factory: OnceLock<Result<ParserFactory, ConstraintError>>,
}

impl GrammarCompiler {
    pub fn new(vocab: Arc<dyn Vocab>, vocab_size: usize) -> Self {
        GrammarCompiler { vocab, vocab_size, factory: OnceLock::new() }
    }

    /// A fresh grammar for one request. Bounded by the shared fuel limits, so an oversized or
    /// pathological constraint is refused rather than left to run.
    pub fn compile(&self, constraint: &Constraint) -> Result<Grammar, ConstraintError> {
        let factory = self
            .factory
            .get_or_init(|| {
                let words: Vec<Vec<u8>> =
                    (0..self.vocab_size as u32).map(|t| self.vocab.token_bytes(t).to_vec()).collect();
                factory_for_vocab(&words, self.vocab.eos_ids()[0])
            })
            .as_ref()
            .map_err(Clone::clone)?;
        let parser = factory.create_parser(constraint.grammar()).map_err(|e| ConstraintError(e.to_string()))?;
        Ok(Grammar { matcher: Matcher::new(Ok(parser)) })
    }
}

/// One request's position in its grammar.
pub struct Grammar {
    matcher: Matcher,
}

/// The tokens allowed at one step, one bit per token id.
pub struct TokenMask(SimpleVob);

impl TokenMask {
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Set every disallowed logit to -inf (a row shorter than the mask is padded by nothing).
    pub fn apply(&self, logits: &mut [f32]) {
        for (word_index, &word) in self.0.as_slice().iter().enumerate() {
            if word == u32::MAX {
                continue;
            }
            let base = word_index * 32;
            for bit in 0..32 {
                if word & (1 << bit) == 0
                    && let Some(l) = logits.get_mut(base + bit)
                {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
}

impl Grammar {
    /// The tokens that keep the output within the grammar; EOS only where it may end. An error
    /// (the grammar reached a state it cannot continue from) ends the request.
    pub fn mask(&mut self) -> Result<TokenMask, ConstraintError> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| ConstraintError(e.to_string()))?;
        if mask.is_zero() {
            return Err(ConstraintError("the constraint allows no token here".into()));
        }
        Ok(TokenMask(mask))
    }

    /// Advance past a token the request generated (or replays after a migration).
    pub fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher.consume_token(token).map_err(|e| ConstraintError(e.to_string()))
    }

    /// The output is complete and nothing may follow: the request ends here.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::sim::SimVocab;

    fn compiler() -> GrammarCompiler {
        GrammarCompiler::new(Arc::new(SimVocab::new(1024)), 1024)
    }

    fn spell(vocab: &SimVocab, text: &str) -> Vec<u32> {
        text.bytes().map(|b| vocab.byte_token(b)).collect()
    }

    #[test]
    fn the_mask_allows_exactly_the_tokens_that_continue_the_grammar() {
        let c = compiler();
        let v = SimVocab::new(1024);
        let mut g = c.compile(&Constraint::Regex("ab|ac".into())).unwrap();
        let m = g.mask().unwrap();
        assert!(m.allows(v.byte_token(b'a')));
        assert!(!m.allows(v.byte_token(b'b')));
        assert!(!m.allows(0), "EOS before the output is complete");
        g.commit(v.byte_token(b'a')).unwrap();
        let m = g.mask().unwrap();
        assert!(m.allows(v.byte_token(b'b')) && m.allows(v.byte_token(b'c')));
        assert!(!m.allows(v.byte_token(b'a')));
        g.commit(v.byte_token(b'c')).unwrap();
        assert!(g.is_complete());
    }

    #[test]
    fn applying_a_mask_sets_only_disallowed_logits_to_minus_infinity() {
        let c = compiler();
        let v = SimVocab::new(1024);
        let mut g = c.compile(&Constraint::Regex("x".into())).unwrap();
        let mut logits = vec![1.0f32; 1024];
        g.mask().unwrap().apply(&mut logits);
        let x = v.byte_token(b'x') as usize;
        assert_eq!(logits[x], 1.0);
        assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), 1);
    }

    #[test]
    fn a_token_outside_the_grammar_cannot_be_committed() {
        let c = compiler();
        let v = SimVocab::new(1024);
        let mut g = c.compile(&Constraint::JsonObject).unwrap();
        for t in spell(&v, "{\"a\":") {
            g.commit(t).unwrap();
        }
        assert!(g.commit(v.byte_token(b'}')).is_err());
    }
}
