//! The prefix cache's index: which token blocks have KV cells on every
//! stage, keyed by the block's tokens and everything before it (vLLM's
//! automatic prefix caching). It lives only here: the stages keep cells
//! shared between sequences and a "kept" flag, and do what each step says
//! (`SeqStart.prefix_cells`, `Step.retain`, `Step.evict`), so every stage's
//! cell table stays the same.
//!
//! A block is [`BLOCK`] tokens. Its key holds the tokens themselves and its
//! parent block, so two different prefixes never collide (a chained hash,
//! as vLLM's, is the same thing with a chance of collision). Only full
//! blocks go in, and a hit is whole blocks: a prompt always computes its
//! last token, so a prompt wholly in the cache computes its last block
//! again (as vLLM does).
//!
//! A block is registered once the step that computed its last token came
//! back from every stage; its cells then belong to the sequence that
//! computed them (it "owns" the block). Sequences that start from it hold a
//! reference. When the owner ends, the block is kept: its cells ride the
//! removal's step in `retain`. Blocks nobody references are evicted least
//! recently used first, leaves first (a block's children hold its cells in
//! their history), when a step needs cells or the size bound is passed.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

/// Tokens per block.
pub const BLOCK: usize = 16;

pub type BlockId = usize;

/// The parent of a first block.
const ROOT: BlockId = usize::MAX;

struct Block {
    parent: BlockId,
    tokens: [u32; BLOCK],
    cells: [i64; BLOCK],
    depth: u32,
    /// Live sequences whose chain holds this block (its owner too).
    refs: u32,
    /// The owner ended and the cache keeps the cells.
    retained: bool,
    /// Blocks whose parent this is.
    children: u32,
    last_used: u64,
}

/// Why blocks were evicted (a metrics label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Evicted {
    /// A step needed the cells.
    Need,
    /// The cache held more than its bound.
    Bound,
}

/// A sequence's blocks: the ones it started from, then the ones it
/// registered (`owned`: it computed the cells; not owned: another
/// sequence had registered the same block first).
#[derive(Debug, Default, Clone)]
pub struct Chain {
    pub blocks: Vec<(BlockId, bool)>,
}

/// What a lookup found: the blocks and their cells, in position order.
#[derive(Debug, Default)]
pub struct Hit {
    pub chain: Chain,
    pub cells: Vec<i64>,
}

pub struct PrefixCache {
    blocks: Vec<Option<Block>>,
    free_ids: Vec<BlockId>,
    index: HashMap<(BlockId, [u32; BLOCK]), BlockId>,
    /// Blocks nobody references and no block hangs under, oldest first
    /// (deeper first on a tie).
    evictable: BTreeSet<(u64, Reverse<u32>, BlockId)>,
    /// Cells of retained blocks (kept only by the cache, or also by
    /// sequences that started from them).
    retained_cells: usize,
    /// Cells of retained blocks nobody references.
    idle_cells: usize,
    /// Most cells `idle_cells` may hold.
    max_idle: usize,
    /// Cells to flag as kept and to give up, on the next step sent.
    pending_retain: Vec<i64>,
    pending_evict: Vec<i64>,
    tick: u64,
}

impl PrefixCache {
    /// A cache that keeps at most `max_cells` cells no running sequence uses.
    pub fn new(max_cells: usize) -> PrefixCache {
        PrefixCache {
            blocks: Vec::new(),
            free_ids: Vec::new(),
            index: HashMap::new(),
            evictable: BTreeSet::new(),
            retained_cells: 0,
            idle_cells: 0,
            max_idle: max_cells,
            pending_retain: Vec::new(),
            pending_evict: Vec::new(),
            tick: 0,
        }
    }

    fn block(&self, id: BlockId) -> &Block {
        self.blocks[id].as_ref().expect("a live block")
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Takes `id` out of, or puts it into, the evictable set after its
    /// refs or children changed (`before`: its key there, if it was in).
    fn update(&mut self, id: BlockId, before: Option<(u64, Reverse<u32>, BlockId)>) {
        if let Some(k) = before {
            self.evictable.remove(&k);
        }
        if let Some(k) = self.key_of(id) {
            self.evictable.insert(k);
        }
    }

    /// `id`'s key in the evictable set, if it belongs there: kept by the
    /// cache, referenced by no sequence, no block under it.
    fn key_of(&self, id: BlockId) -> Option<(u64, Reverse<u32>, BlockId)> {
        let b = self.block(id);
        (b.refs == 0 && b.children == 0 && b.retained).then_some((
            b.last_used,
            Reverse(b.depth),
            id,
        ))
    }

    /// Adds one reference to `id` and marks it used now.
    fn take_ref(&mut self, id: BlockId) {
        let before = self.key_of(id);
        let tick = self.next_tick();
        let b = self.blocks[id].as_mut().unwrap();
        if b.refs == 0 && b.retained {
            self.idle_cells -= BLOCK;
        }
        b.refs += 1;
        b.last_used = tick;
        self.update(id, before);
    }

    /// The longest run of cached blocks `prompt` starts with, leaving at
    /// least its last token to compute. Each block found is referenced
    /// until [`Self::release`].
    pub fn lookup(&mut self, prompt: &[u32]) -> Hit {
        let mut hit = Hit::default();
        let n_blocks = prompt.len().saturating_sub(1) / BLOCK;
        let mut parent = ROOT;
        for i in 0..n_blocks {
            let tokens: [u32; BLOCK] = prompt[i * BLOCK..(i + 1) * BLOCK].try_into().unwrap();
            let Some(&id) = self.index.get(&(parent, tokens)) else {
                break;
            };
            self.take_ref(id);
            hit.chain.blocks.push((id, false));
            hit.cells.extend_from_slice(&self.block(id).cells);
            parent = id;
        }
        hit
    }

    /// Registers the full blocks of a sequence's fed tokens past those its
    /// chain holds: `tokens[i]` went into `cells[i]` on every stage.
    pub fn register(&mut self, chain: &mut Chain, tokens: &[u32], cells: &[i64]) {
        let known = cells.len().min(tokens.len());
        while (chain.blocks.len() + 1) * BLOCK <= known {
            let i = chain.blocks.len();
            let parent = chain.blocks.last().map_or(ROOT, |&(id, _)| id);
            let toks: [u32; BLOCK] = tokens[i * BLOCK..(i + 1) * BLOCK].try_into().unwrap();
            if let Some(&id) = self.index.get(&(parent, toks)) {
                self.take_ref(id);
                chain.blocks.push((id, false));
                continue;
            }
            let tick = self.next_tick();
            let block = Block {
                parent,
                tokens: toks,
                cells: cells[i * BLOCK..(i + 1) * BLOCK].try_into().unwrap(),
                depth: i as u32,
                refs: 1,
                retained: false,
                children: 0,
                last_used: tick,
            };
            let id = match self.free_ids.pop() {
                Some(id) => {
                    self.blocks[id] = Some(block);
                    id
                }
                None => {
                    self.blocks.push(Some(block));
                    self.blocks.len() - 1
                }
            };
            self.index.insert((parent, toks), id);
            if parent != ROOT {
                let before = self.key_of(parent);
                self.blocks[parent].as_mut().unwrap().children += 1;
                self.update(parent, before);
            }
            chain.blocks.push((id, true));
        }
    }

    /// A sequence ended: its references go, and the blocks it owns are
    /// kept (their cells go into the next step's `retain`, which must be
    /// the step that carries the sequence's removal).
    pub fn release(&mut self, chain: Chain) {
        let tick = self.next_tick();
        for (id, owned) in chain.blocks {
            let before = self.key_of(id);
            let b = self.blocks[id].as_mut().unwrap();
            b.refs -= 1;
            b.last_used = tick;
            if owned {
                b.retained = true;
                self.retained_cells += BLOCK;
                self.pending_retain.extend_from_slice(&b.cells);
            }
            if b.refs == 0 {
                self.idle_cells += BLOCK;
            }
            self.update(id, before);
        }
    }

    /// Evicts the least recently used block nobody references. False if
    /// there is none.
    fn evict_one(&mut self) -> bool {
        let Some(&k) = self.evictable.iter().next() else {
            return false;
        };
        self.evictable.remove(&k);
        let id = k.2;
        let b = self.blocks[id].take().unwrap();
        self.free_ids.push(id);
        self.index.remove(&(b.parent, b.tokens));
        self.pending_evict.extend_from_slice(&b.cells);
        self.retained_cells -= BLOCK;
        self.idle_cells -= BLOCK;
        if b.parent != ROOT {
            let before = self.key_of(b.parent);
            self.blocks[b.parent].as_mut().unwrap().children -= 1;
            self.update(b.parent, before);
        }
        true
    }

    /// Evicts until at most `keep` retained cells are left, or nothing
    /// more can go. Returns how many blocks went.
    pub fn shrink_to(&mut self, keep: usize) -> usize {
        let mut n = 0;
        while self.retained_cells > keep && self.evict_one() {
            n += 1;
        }
        n
    }

    /// Evicts until the idle cells are within the bound. Returns how many
    /// blocks went.
    pub fn enforce_bound(&mut self) -> usize {
        let mut n = 0;
        while self.idle_cells > self.max_idle && self.evict_one() {
            n += 1;
        }
        n
    }

    /// Cells of retained blocks: what the cache holds beyond the running
    /// sequences' own cells.
    pub fn retained_cells(&self) -> usize {
        self.retained_cells
    }

    /// Blocks in the index.
    pub fn blocks(&self) -> usize {
        self.index.len()
    }

    /// The cells to flag and to give up on the next step sent.
    pub fn take_pending(&mut self) -> (Vec<i64>, Vec<i64>) {
        (
            std::mem::take(&mut self.pending_retain),
            std::mem::take(&mut self.pending_evict),
        )
    }

    pub fn has_pending(&self) -> bool {
        !self.pending_retain.is_empty() || !self.pending_evict.is_empty()
    }

    /// Forgets every block (the stages were reset, so every cell is free).
    /// Returns how many there were.
    pub fn clear(&mut self) -> usize {
        let n = self.index.len();
        *self = PrefixCache::new(self.max_idle);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    fn cells(from: i64, n: usize) -> Vec<i64> {
        (from..from + n as i64).collect()
    }

    #[test]
    fn a_hit_is_whole_blocks_and_leaves_the_last_token() {
        let mut pc = PrefixCache::new(1000);
        let p = toks(50, 1);
        let mut chain = Chain::default();
        pc.register(&mut chain, &p, &cells(0, 50));
        assert_eq!(chain.blocks.len(), 3);
        assert!(chain.blocks.iter().all(|&(_, owned)| owned));
        // A prompt that goes on: 3 blocks.
        let mut longer = p.clone();
        longer.extend([1, 2, 3]);
        let hit = pc.lookup(&longer);
        assert_eq!(hit.cells, cells(0, 48));
        // Exactly 48 tokens: the last block is computed again.
        let hit2 = pc.lookup(&p[..48]);
        assert_eq!(hit2.cells, cells(0, 32));
        // 49 tokens: 3 blocks, token 48 computed.
        let hit3 = pc.lookup(&p[..49]);
        assert_eq!(hit3.cells.len(), 48);
        // Another first block misses.
        assert!(pc.lookup(&toks(40, 2)).cells.is_empty());
        // A different second block stops the hit after the first.
        let mut other = p.clone();
        other[20] = 9999;
        assert_eq!(pc.lookup(&other).cells, cells(0, 16));
    }

    #[test]
    fn owned_blocks_are_kept_when_the_owner_ends_and_evicted_lru_leaf_first() {
        let mut pc = PrefixCache::new(1000);
        let a = toks(32, 1);
        let b = toks(32, 2);
        let (mut ca, mut cb) = (Chain::default(), Chain::default());
        pc.register(&mut ca, &a, &cells(0, 32));
        pc.register(&mut cb, &b, &cells(32, 32));
        assert_eq!(pc.retained_cells(), 0);
        pc.release(ca);
        let (retain, evict) = pc.take_pending();
        assert_eq!(retain, cells(0, 32));
        assert!(evict.is_empty());
        pc.release(cb);
        assert_eq!(pc.retained_cells(), 64);
        pc.take_pending();
        // A hit on a's first block makes it newer than b's blocks.
        let hit = pc.lookup(&a[..20]);
        assert_eq!(hit.cells, cells(0, 16));
        // Referenced blocks never go; a's second block is a leaf and the
        // oldest unreferenced: it goes first, then b's leaf, then b's root.
        assert_eq!(pc.shrink_to(0), 3);
        let (_, evict) = pc.take_pending();
        assert_eq!(evict[..16], cells(16, 16)[..]);
        assert_eq!(evict[16..32], cells(48, 16)[..]);
        assert_eq!(evict[32..], cells(32, 16)[..]);
        assert_eq!(pc.retained_cells(), 16);
        pc.release(hit.chain);
        assert_eq!(pc.shrink_to(0), 1);
        assert_eq!(pc.blocks(), 0);
    }

    #[test]
    fn a_block_registered_twice_is_shared_and_the_copy_is_not_kept() {
        let mut pc = PrefixCache::new(1000);
        let p = toks(40, 3);
        let (mut c1, mut c2) = (Chain::default(), Chain::default());
        pc.register(&mut c1, &p, &cells(0, 40));
        pc.register(&mut c2, &p, &cells(100, 40));
        assert_eq!(
            c2.blocks,
            c1.blocks
                .iter()
                .map(|&(id, _)| (id, false))
                .collect::<Vec<_>>()
        );
        pc.release(c2);
        assert!(pc.take_pending().0.is_empty());
        pc.release(c1);
        assert_eq!(pc.take_pending().0, cells(0, 32));
    }

    #[test]
    fn the_bound_counts_only_blocks_nobody_uses() {
        let mut pc = PrefixCache::new(32);
        let mut chains = Vec::new();
        for salt in 0..3 {
            let mut c = Chain::default();
            pc.register(&mut c, &toks(32, salt), &cells(32 * salt as i64, 32));
            chains.push(c);
        }
        let held = pc.lookup(&toks(33, 0));
        for c in chains {
            pc.release(c);
        }
        // 96 retained; 32 referenced by `held`; 64 idle, 32 over the bound.
        assert_eq!(pc.enforce_bound(), 2);
        assert_eq!(pc.retained_cells(), 64);
        pc.release(held.chain);
        assert_eq!(pc.enforce_bound(), 2);
        assert_eq!(pc.retained_cells(), 32);
    }

    #[test]
    fn a_parent_goes_only_after_its_children() {
        let mut pc = PrefixCache::new(0);
        let mut c = Chain::default();
        pc.register(&mut c, &toks(64, 5), &cells(0, 64));
        pc.release(c);
        pc.take_pending();
        pc.enforce_bound();
        let (_, evict) = pc.take_pending();
        let order: Vec<i64> = evict.chunks(BLOCK).map(|b| b[0]).collect();
        assert_eq!(order, vec![48, 32, 16, 0]);
        assert_eq!(pc.clear(), 0);
    }
}
