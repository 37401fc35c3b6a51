//! Garbage input must produce errors, never panics

use super::*;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Whatever parses must also be safe to query.
fn exercise(bytes: Vec<u8>) {
    if let Ok(g) = Gguf::from_bytes(bytes) {
        for t in g.tensors() {
            assert_eq!(g.tensor_data(t).unwrap().len() as u64, t.size);
        }
        g.layer_bytes();
        g.non_layer_bytes();
        let _ = g.check_architecture(SUPPORTED_ARCHITECTURES);
    }
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for i in 0..200u32 {
        let len = rng.below(2048) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if i.is_multiple_of(2) {
            // A valid header with small counts, so the parser gets past the first checks.
            let mut header = b"GGUF".to_vec();
            header.extend(3u32.to_le_bytes());
            header.extend(rng.below(4).to_le_bytes());
            header.extend(rng.below(4).to_le_bytes());
            header.append(&mut bytes);
            bytes = header;
        }
        exercise(bytes);
    }
}

#[test]
fn mutated_files_never_panic() {
    let original = sample_file(3);
    let mut rng = XorShift(42);
    for _ in 0..3000 {
        let mut bytes = original.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(bytes.len() as u64) as usize;
            bytes[at] = match rng.below(3) {
                0 => rng.next() as u8,
                1 => 0xff,
                _ => bytes[at] ^ (1 << rng.below(8)),
            };
        }
        exercise(bytes);
    }
}
