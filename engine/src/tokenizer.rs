//! Text to token ids and back, with exactly llama.cpp's ids (its own
//! tokenizer, loaded vocab-only), and a stream decoder that never splits a
//! UTF-8 character between two pieces.

use std::path::Path;

use crate::error::EngineError;
use crate::ffi::vocab::Vocab;

pub struct Tokenizer {
    vocab: Vocab,
}

impl Tokenizer {
    /// Loads the vocabulary of a GGUF that [`crate::ModelFile::open`] has validated.
    pub fn load(path: &Path) -> Result<Tokenizer, EngineError> {
        Ok(Tokenizer {
            vocab: Vocab::load(path).map_err(EngineError::Tokenizer)?,
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.n_tokens()
    }
    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos()
    }
    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos()
    }
    /// Whether the model wants BOS at the start of a prompt (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos()
    }
    /// End-of-generation tokens (EOS, EOT, `<end_of_turn>`, `<|im_end|>`, ...).
    pub fn is_eog(&self, t: u32) -> bool {
        self.vocab.is_eog(t)
    }

    /// Tokenizes like `llama_tokenize(add_special, parse_special)`.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.vocab
            .tokenize(text, add_special, parse_special)
            .map_err(EngineError::Tokenizer)
    }

    /// The raw bytes of a token; control tokens render as their text.
    pub fn piece(&self, t: u32) -> Vec<u8> {
        self.vocab.piece(t, true)
    }

    /// The bytes of a token as text; empty for control tokens (`<|im_end|>`).
    pub fn plain_piece(&self, t: u32) -> Vec<u8> {
        self.vocab.piece(t, false)
    }

    /// Text of a whole sequence (lossy only if the ids themselves end mid-character).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&t| self.piece(t)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn text_of(&self, t: u32) -> String {
        String::from_utf8_lossy(&self.piece(t)).into_owned()
    }
}

/// Turns a stream of token byte pieces into text without ever emitting a
/// broken UTF-8 character: bytes of an unfinished character wait for the
/// next piece.
#[derive(Default, Debug)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds a token's bytes; returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: from_utf8 just told us this prefix is valid.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // Unfinished character at the end: keep it for later.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        // Invalid bytes in the middle: replace them, as lossy decoding would.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + n);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left when the stream ends (a truncated character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::StreamDecoder;

    #[test]
    fn multibyte_characters_split_across_pieces_come_out_whole() {
        let text = "héllo 👋🏽 世界";
        let bytes = text.as_bytes();
        let mut d = StreamDecoder::default();
        let mut out = String::new();
        for b in bytes {
            let piece = d.push(&[*b]);
            assert!(!piece.contains('\u{FFFD}'));
            out.push_str(&piece);
        }
        out.push_str(&d.finish());
        assert_eq!(out, text);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut d = StreamDecoder::default();
        assert_eq!(d.push(&[b'a', 0xff, b'b']), "a\u{FFFD}b");
        assert_eq!(d.push(&[0xe4, 0xb8]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
