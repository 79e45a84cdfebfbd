//! Incremental detokenization for streaming.
//!
//! A byte-level BPE token is a run of *bytes*, not of characters: one emoji can span two or three
//! tokens, and a token can end in the middle of a UTF-8 sequence. Decoding each token on its own
//! would stream U+FFFD garbage where the full text has a perfectly good character; re-decoding the
//! whole sequence each step and diffing is quadratic and emits a character twice when a replacement
//! character later turns into a real one.
//!
//! [`Detokenizer`] keeps only the bytes of an unfinished UTF-8 sequence at the end of the stream.
//! Invariant: every byte pushed is emitted exactly once, and the concatenation of everything
//! returned by [`Detokenizer::push`] and [`Detokenizer::finish`] equals
//! `String::from_utf8_lossy` of all the bytes pushed.

/// Turns a stream of token bytes into a stream of complete UTF-8 text.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    /// Bytes of a UTF-8 sequence that has started but not yet ended (at most 3 bytes).
    pending: Vec<u8>,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append a token's bytes; returns the newly complete text: never splits a UTF-8 character,
    /// never emits a byte twice. Invalid bytes become U+FFFD as soon as they are known to be invalid.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        if bytes.is_empty() {
            return String::new();
        }
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &buf;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid_up_to` guarantees this prefix is valid UTF-8.
                    out.push_str(std::str::from_utf8(valid).expect("valid prefix"));
                    match e.error_len() {
                        // The tail is a valid-so-far prefix of a character: wait for more bytes.
                        None => {
                            self.pending = after.to_vec();
                            break;
                        }
                        // Bytes that can never become valid: replace them now, like from_utf8_lossy.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                    }
                }
            }
        }
        out
    }

    /// Flush what is left at end of stream (incomplete sequences become U+FFFD).
    pub fn finish(&mut self) -> String {
        let pending = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&pending).into_owned()
    }

    /// Whether bytes of an unfinished character are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLES: &[&str] = &["你好，世界", "I ❤️ 🦀 and 👩‍👩‍👧", "naïve café", "plain ascii", "mixed 日本語 text 🎉!"];

    /// Feeds `chunks` and checks that each emission is whole characters and that the concatenation
    /// is the lossy decoding of all bytes (so no byte is lost or repeated).
    fn stream(chunks: &[&[u8]]) -> (Vec<String>, String) {
        let mut d = Detokenizer::new();
        let mut pieces: Vec<String> = chunks.iter().map(|c| d.push(c)).collect();
        pieces.push(d.finish());
        let joined = pieces.concat();
        (pieces, joined)
    }

    #[test]
    fn byte_by_byte_feeding_reassembles_multibyte_chars_without_splitting() {
        for s in SAMPLES {
            let bytes = s.as_bytes();
            let chunks: Vec<&[u8]> = bytes.chunks(1).collect();
            let (pieces, joined) = stream(&chunks);
            assert_eq!(joined, *s);
            assert!(
                pieces.iter().all(|p| !p.contains('\u{FFFD}')),
                "{s:?} streamed a replacement character: {pieces:?}"
            );
        }
    }

    #[test]
    fn every_chunking_of_the_bytes_yields_the_text_exactly_once() {
        // All split points into 2 and 3 chunks: covers tokens ending mid-character at every offset.
        for s in SAMPLES {
            let b = s.as_bytes();
            for i in 0..=b.len() {
                for j in i..=b.len() {
                    let (pieces, joined) = stream(&[&b[..i], &b[i..j], &b[j..]]);
                    assert_eq!(joined, *s, "split at {i},{j}: {pieces:?}");
                    assert!(!joined.contains('\u{FFFD}'));
                }
            }
        }
    }

    #[test]
    fn token_sized_chunks_of_emoji_emit_each_char_once_when_complete() {
        // 🦀 is F0 9F A6 80: a byte-level BPE may cut it as [F0 9F] [A6 80].
        let mut d = Detokenizer::new();
        assert_eq!(d.push(b"a \xF0\x9F"), "a ");
        assert!(d.has_pending());
        assert_eq!(d.push(b"\xA6\x80!"), "🦀!");
        assert!(!d.has_pending());
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn finish_flushes_an_incomplete_sequence_as_replacement_char() {
        let mut d = Detokenizer::new();
        assert_eq!(d.push(b"ok\xE4\xBD"), "ok");
        assert_eq!(d.finish(), "\u{FFFD}");
        // Nothing is emitted twice after a flush.
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_are_replaced_immediately_and_match_lossy_decoding() {
        let cases: &[&[u8]] = &[b"a\xFFb", b"\x80\x80x", b"\xE4\xBDz", b"\xF0\x9F\xA6"];
        for bytes in cases {
            let chunks: Vec<&[u8]> = bytes.chunks(1).collect();
            let (_, joined) = stream(&chunks);
            assert_eq!(joined, String::from_utf8_lossy(bytes), "{bytes:?}");
        }
        // An invalid byte is not held back waiting for more input.
        let mut d = Detokenizer::new();
        assert_eq!(d.push(b"a\xFF"), "a\u{FFFD}");
    }

    #[test]
    fn empty_pushes_emit_nothing() {
        let mut d = Detokenizer::new();
        assert_eq!(d.push(b""), "");
        assert_eq!(d.push(b"\xE4"), "");
        assert_eq!(d.push(b""), "");
        assert_eq!(d.push(b"\xBD\xA0"), "你");
    }
}
