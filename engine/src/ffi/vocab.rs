//! llama.cpp's tokenizer, loaded in vocab-only mode (no weights are read).
//! Using llama.cpp's own implementation is what makes our token ids identical
//! to llama.cpp's for every pre-tokenizer it supports.

use std::ffi::{c_char, CString};
use std::path::Path;
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

pub struct Vocab {
    model: NonNull<sys::llama_model>,
    vocab: NonNull<sys::llama_vocab>,
}

// SAFETY: llama.cpp's vocab is immutable after load; its tokenize and
// token_to_piece functions are documented as thread-safe (they use only
// per-call state plus a read-only cache filled at load time).
unsafe impl Send for Vocab {}
unsafe impl Sync for Vocab {}

impl Vocab {
    /// Loads only the vocabulary of the GGUF at `path`. The caller has already
    /// validated the file (architecture, keys) with our own reader.
    pub fn load(path: &Path) -> Result<Vocab, String> {
        super::ggml::init_logging();
        // A split model is loaded from its first part.
        let first = crate::gguf::split::first_part(path);
        let c_path = CString::new(first.as_os_str().as_encoded_bytes())
            .map_err(|_| "path contains a NUL byte".to_string())?;
        // SAFETY: default params from llama.cpp, then only plain fields changed.
        let model = unsafe {
            let mut p = sys::llama_model_default_params();
            p.vocab_only = true;
            p.n_gpu_layers = 0;
            sys::llama_model_load_from_file(c_path.as_ptr(), p)
        };
        let model = NonNull::new(model).ok_or_else(|| {
            format!(
                "llama.cpp could not load the vocabulary of {}",
                path.display()
            )
        })?;
        // SAFETY: valid model; the vocab lives as long as the model.
        let vocab = unsafe { sys::llama_model_get_vocab(model.as_ptr()) } as *mut sys::llama_vocab;
        let vocab = NonNull::new(vocab).ok_or("model has no vocabulary")?;
        Ok(Vocab { model, vocab })
    }

    fn v(&self) -> *const sys::llama_vocab {
        self.vocab.as_ptr()
    }

    pub fn n_tokens(&self) -> usize {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_n_tokens(self.v()) }.max(0) as usize
    }

    pub fn bos(&self) -> Option<u32> {
        // SAFETY: valid vocab.
        tok(unsafe { sys::llama_vocab_bos(self.v()) })
    }
    pub fn eos(&self) -> Option<u32> {
        // SAFETY: valid vocab.
        tok(unsafe { sys::llama_vocab_eos(self.v()) })
    }
    pub fn add_bos(&self) -> bool {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_get_add_bos(self.v()) }
    }
    pub fn is_eog(&self, t: u32) -> bool {
        // SAFETY: llama.cpp bounds-checks the id.
        t < self.n_tokens() as u32 && unsafe { sys::llama_vocab_is_eog(self.v(), t as i32) }
    }

    /// Token ids for `text`. `add_special` adds BOS/EOS as the model asks;
    /// `parse_special` matches control-token text like `<|im_start|>`.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, String> {
        let len = i32::try_from(text.len())
            .map_err(|_| format!("text of {} bytes is too long to tokenize", text.len()))?;
        let mut out = vec![0i32; text.len() + 2];
        for _ in 0..2 {
            // SAFETY: `text` has `len` bytes; `out` has out.len() slots.
            let n = unsafe {
                sys::llama_tokenize(
                    self.v(),
                    text.as_ptr() as *const c_char,
                    len,
                    out.as_mut_ptr(),
                    out.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n >= 0 {
                out.truncate(n as usize);
                return Ok(out.into_iter().map(|t| t as u32).collect());
            }
            if n == i32::MIN {
                return Err("tokenization overflowed".into());
            }
            out.resize((-n) as usize, 0);
        }
        Err("tokenizer disagreed with itself about the output size".into())
    }

    /// The bytes of one token (special tokens rendered when `special`).
    pub fn piece(&self, t: u32, special: bool) -> Vec<u8> {
        if t >= self.n_tokens() as u32 {
            return Vec::new();
        }
        let mut buf = vec![0u8; 64];
        for _ in 0..2 {
            // SAFETY: `buf` has buf.len() bytes; id is in range.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.v(),
                    t as i32,
                    buf.as_mut_ptr() as *mut c_char,
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return buf;
            }
            buf.resize((-n) as usize, 0);
        }
        Vec::new()
    }
}

fn tok(t: i32) -> Option<u32> {
    (t >= 0).then_some(t as u32)
}

impl Drop for Vocab {
    fn drop(&mut self) {
        // SAFETY: we own the model; the vocab pointer dies with it.
        unsafe { sys::llama_model_free(self.model.as_ptr()) }
    }
}
