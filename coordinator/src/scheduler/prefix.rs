//! The prefix cache's index: which token blocks have KV cells on every
//! stage, keyed by the block's tokens and everything before it (vLLM's
//! automatic prefix caching). It lives only here: the stages keep cells
//! shared between sequences and a "kept" flag, and do what each step says
//! (`SeqStart.prefix_cells`, `Step.retain`, `Step.evict`), so every stage's
//! cell table stays the same.
//!
//! A block is [`BLOCK`] tokens. Its key holds the tokens themselves and its
//! parent block, so two different prefixes never collide (a chained hash,
//! as vLLM's, is the same thing with a chance of collision). A sequence's
//! last tokens past its last full block go in too when it ends, as a
//! *tail*: a block of fewer tokens that is never a parent.
//!
//! A hit is the exact common prefix, as llama-server's: whole blocks as
//! far as they match, then the first tokens of the child block (full or
//! tail) that shares the most with what follows. It leaves at least the
//! prompt's last token to compute (its logits are wanted). A sequence that
//! starts from part of a block computes the rest of that block into cells
//! of its own, so its own block holds cells of another: a cell may belong
//! to several kept blocks, and the stages are told to keep it when the
//! first of them is kept and to let it go when the last is evicted.
//!
//! A full block is registered once the step that computed its last token
//! came back from every stage; its cells then belong to the sequence that
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

/// The parent of a first block computed by the fast kernels, and of one
/// computed by batch-invariant steps: two trees, so that a deterministic
/// sequence starts only from cells computed as it would compute them.
const ROOT: BlockId = usize::MAX;
const ROOT_INVARIANT: BlockId = usize::MAX - 1;

fn is_root(id: BlockId) -> bool {
    id >= ROOT_INVARIANT
}

struct Block {
    parent: BlockId,
    tokens: [u32; BLOCK],
    cells: [i64; BLOCK],
    /// Tokens it holds: [`BLOCK`], or fewer for a tail.
    len: usize,
    depth: u32,
    /// Live sequences whose chain holds this block (its owner too).
    refs: u32,
    /// The owner ended and the cache keeps the cells.
    retained: bool,
    /// Blocks whose parent this is.
    children: u32,
    last_used: u64,
}

impl Block {
    fn tokens(&self) -> &[u32] {
        &self.tokens[..self.len]
    }

    fn cells(&self) -> &[i64] {
        &self.cells[..self.len]
    }
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
/// sequence had registered the same block first); and the block it took
/// the first tokens of, past its whole blocks.
#[derive(Debug, Default, Clone)]
pub struct Chain {
    pub blocks: Vec<(BlockId, bool)>,
    pub partial: Option<BlockId>,
    /// A deterministic sequence's: in the batch-invariant tree.
    pub invariant: bool,
}

impl Chain {
    /// An empty chain in the tree of `invariant` sequences or the other.
    pub fn new(invariant: bool) -> Chain {
        Chain {
            invariant,
            ..Chain::default()
        }
    }

    /// The block the next one hangs under.
    fn last(&self) -> BlockId {
        match self.blocks.last() {
            Some(&(id, _)) => id,
            None if self.invariant => ROOT_INVARIANT,
            None => ROOT,
        }
    }
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
    /// Full blocks by parent and tokens.
    index: HashMap<(BlockId, [u32; BLOCK]), BlockId>,
    /// Every block (full or tail) by parent and first token: where a hit
    /// that ends inside a block looks.
    starts: HashMap<(BlockId, u32), Vec<BlockId>>,
    /// Blocks nobody references and no block hangs under, oldest first
    /// (deeper first on a tie).
    evictable: BTreeSet<(u64, Reverse<u32>, BlockId)>,
    /// How many retained blocks hold each cell the stages keep.
    kept: HashMap<i64, u32>,
    /// Cells of retained blocks nobody references (a cell in two such
    /// blocks counts twice, so the bound errs on the side of evicting).
    idle_cells: usize,
    /// Most cells `idle_cells` may hold.
    max_idle: usize,
    /// Cells whose kept state changed since the last step sent, in order,
    /// with whether the stages kept them then: the next step flags or
    /// frees only those whose state differs now.
    changed: Vec<i64>,
    kept_before: HashMap<i64, bool>,
    tick: u64,
}

impl PrefixCache {
    /// A cache that keeps at most `max_cells` cells no running sequence uses.
    pub fn new(max_cells: usize) -> PrefixCache {
        PrefixCache {
            blocks: Vec::new(),
            free_ids: Vec::new(),
            index: HashMap::new(),
            starts: HashMap::new(),
            evictable: BTreeSet::new(),
            kept: HashMap::new(),
            idle_cells: 0,
            max_idle: max_cells,
            changed: Vec::new(),
            kept_before: HashMap::new(),
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
            self.idle_cells -= b.len;
        }
        b.refs += 1;
        b.last_used = tick;
        self.update(id, before);
    }

    /// Drops one reference to `id`; an owner's block is kept from now on.
    fn drop_ref(&mut self, id: BlockId, owned: bool, tick: u64) {
        let before = self.key_of(id);
        let b = self.blocks[id].as_mut().unwrap();
        b.refs -= 1;
        b.last_used = tick;
        b.retained |= owned;
        let (len, refs, retained, cells) = (b.len, b.refs, b.retained, b.cells);
        if owned {
            self.keep(&cells[..len]);
        }
        if refs == 0 && retained {
            self.idle_cells += len;
        }
        self.update(id, before);
    }

    /// Records that the stages' kept flag of `c` may change on the next step.
    fn changed(&mut self, c: i64, kept_before: bool) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.kept_before.entry(c) {
            e.insert(kept_before);
            self.changed.push(c);
        }
    }

    /// One more kept block holds each of `cells`.
    fn keep(&mut self, cells: &[i64]) {
        for &c in cells {
            let n = self.kept.entry(c).or_insert(0);
            *n += 1;
            if *n == 1 {
                self.changed(c, false);
            }
        }
    }

    /// One kept block fewer holds each of `cells`.
    fn unkeep(&mut self, cells: &[i64]) {
        for &c in cells {
            let n = self.kept.get_mut(&c).expect("a kept cell");
            *n -= 1;
            if *n == 0 {
                self.kept.remove(&c);
                self.changed(c, true);
            }
        }
    }

    /// The child of `parent` (a full block or a tail) that begins with
    /// the most of `tokens`, and how many.
    fn best_start(&self, parent: BlockId, tokens: &[u32]) -> Option<(BlockId, usize)> {
        let first = *tokens.first()?;
        self.starts
            .get(&(parent, first))?
            .iter()
            .map(|&id| {
                let common = self
                    .block(id)
                    .tokens()
                    .iter()
                    .zip(tokens)
                    .take_while(|(a, b)| a == b)
                    .count();
                (id, common)
            })
            .max_by_key(|&(id, common)| (common, Reverse(id)))
    }

    /// The longest cached prefix of `prompt`, leaving at least its last
    /// `tail` tokens (at least 1) to compute: whole blocks, then the first
    /// tokens of a child (in the tree of `invariant` sequences, or the
    /// other). Each block found is referenced until [`Self::release`].
    pub fn lookup(&mut self, prompt: &[u32], invariant: bool, tail: usize) -> Hit {
        let mut hit = Hit {
            chain: Chain::new(invariant),
            cells: Vec::new(),
        };
        let limit = prompt.len().saturating_sub(tail.max(1));
        let mut parent = hit.chain.last();
        for i in 0..limit / BLOCK {
            let tokens: [u32; BLOCK] = prompt[i * BLOCK..(i + 1) * BLOCK].try_into().unwrap();
            let Some(&id) = self.index.get(&(parent, tokens)) else {
                break;
            };
            self.take_ref(id);
            hit.chain.blocks.push((id, false));
            hit.cells.extend_from_slice(self.block(id).cells());
            parent = id;
        }
        let at = hit.cells.len();
        let rest = &prompt[at..limit.min(at + BLOCK)];
        if let Some((id, common)) = self.best_start(parent, rest) {
            self.take_ref(id);
            hit.chain.partial = Some(id);
            hit.cells
                .extend_from_slice(&self.block(id).cells()[..common]);
        }
        hit
    }

    /// Puts a new block in the index, referenced by its owner, or kept
    /// at once (a tail).
    fn insert(
        &mut self,
        parent: BlockId,
        tokens: &[u32],
        cells: &[i64],
        depth: u32,
        kept: bool,
    ) -> BlockId {
        let len = tokens.len();
        let mut block = Block {
            parent,
            tokens: [0; BLOCK],
            cells: [0; BLOCK],
            len,
            depth,
            refs: u32::from(!kept),
            retained: kept,
            children: 0,
            last_used: self.next_tick(),
        };
        block.tokens[..len].copy_from_slice(tokens);
        block.cells[..len].copy_from_slice(cells);
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
        if len == BLOCK {
            self.index.insert((parent, tokens.try_into().unwrap()), id);
        }
        self.starts.entry((parent, tokens[0])).or_default().push(id);
        if !is_root(parent) {
            let before = self.key_of(parent);
            self.blocks[parent].as_mut().unwrap().children += 1;
            self.update(parent, before);
        }
        if kept {
            self.keep(cells);
            self.idle_cells += len;
            self.update(id, None);
        }
        id
    }

    /// Registers the full blocks of a sequence's fed tokens past those its
    /// chain holds: `tokens[i]` went into `cells[i]` on every stage.
    pub fn register(&mut self, chain: &mut Chain, tokens: &[u32], cells: &[i64]) {
        let known = cells.len().min(tokens.len());
        while (chain.blocks.len() + 1) * BLOCK <= known {
            let i = chain.blocks.len();
            let parent = chain.last();
            let span = i * BLOCK..(i + 1) * BLOCK;
            let toks: [u32; BLOCK] = tokens[span.clone()].try_into().unwrap();
            if let Some(&id) = self.index.get(&(parent, toks)) {
                self.take_ref(id);
                chain.blocks.push((id, false));
                continue;
            }
            let id = self.insert(parent, &toks, &cells[span], i as u32, false);
            chain.blocks.push((id, true));
        }
    }

    /// A sequence ended: its references go, and the blocks it owns are
    /// kept (their cells go into the next step's `retain`, which must be
    /// the step that carries the sequence's removal). With `tail` (its fed
    /// tokens and their cells, as given to [`Self::register`]), the tokens
    /// past its last full block are kept too, unless a block already
    /// begins with them.
    pub fn release(&mut self, chain: Chain, tail: Option<(&[u32], &[i64])>) {
        let tick = self.next_tick();
        for &(id, owned) in &chain.blocks {
            self.drop_ref(id, owned, tick);
        }
        if let Some(id) = chain.partial {
            self.drop_ref(id, false, tick);
        }
        let Some((tokens, cells)) = tail else {
            return;
        };
        let at = chain.blocks.len() * BLOCK;
        let known = cells.len().min(tokens.len());
        // Nothing past the full blocks; or blocks not registered yet (a
        // recovery's replay had not given them back): keep nothing.
        if at >= known || known - at >= BLOCK {
            return;
        }
        let parent = chain.last();
        let rest = &tokens[at..known];
        if self
            .best_start(parent, rest)
            .is_some_and(|(_, common)| common == rest.len())
        {
            return;
        }
        self.insert(
            parent,
            rest,
            &cells[at..known],
            chain.blocks.len() as u32,
            true,
        );
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
        if b.len == BLOCK {
            self.index.remove(&(b.parent, b.tokens));
        }
        let key = (b.parent, b.tokens[0]);
        let siblings = self.starts.get_mut(&key).expect("an indexed block");
        siblings.retain(|&s| s != id);
        if siblings.is_empty() {
            self.starts.remove(&key);
        }
        self.unkeep(b.cells());
        self.idle_cells -= b.len;
        if !is_root(b.parent) {
            let before = self.key_of(b.parent);
            self.blocks[b.parent].as_mut().unwrap().children -= 1;
            self.update(b.parent, before);
        }
        true
    }

    /// Evicts until at most `keep` cells are kept, or nothing more can go.
    /// Returns how many blocks went.
    pub fn shrink_to(&mut self, keep: usize) -> usize {
        let mut n = 0;
        while self.kept.len() > keep && self.evict_one() {
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

    /// Cells the cache keeps: what it holds beyond the running sequences'
    /// own cells.
    pub fn retained_cells(&self) -> usize {
        self.kept.len()
    }

    /// Blocks in the index (full ones and tails).
    pub fn blocks(&self) -> usize {
        self.blocks.len() - self.free_ids.len()
    }

    /// The cells to flag and to give up on the next step sent: those whose
    /// kept state differs from what the stages were last told.
    pub fn take_pending(&mut self) -> (Vec<i64>, Vec<i64>) {
        let (mut retain, mut evict) = (Vec::new(), Vec::new());
        for c in std::mem::take(&mut self.changed) {
            let before = self.kept_before.remove(&c).unwrap();
            match (before, self.kept.contains_key(&c)) {
                (false, true) => retain.push(c),
                (true, false) => evict.push(c),
                _ => {}
            }
        }
        (retain, evict)
    }

    pub fn has_pending(&self) -> bool {
        !self.changed.is_empty()
    }

    /// Forgets every block (the stages were reset, so every cell is free).
    /// Returns how many there were.
    pub fn clear(&mut self) -> usize {
        let n = self.blocks();
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

    /// Registers `tokens` fed into `cells` as one sequence, and ends it
    /// (keeping its tail).
    fn run(pc: &mut PrefixCache, tokens: &[u32], cells: &[i64]) {
        let mut chain = Chain::default();
        pc.register(&mut chain, tokens, cells);
        pc.release(chain, Some((tokens, cells)));
    }

    #[test]
    fn a_hit_is_the_common_prefix_and_leaves_the_last_token() {
        let mut pc = PrefixCache::new(1000);
        let p = toks(50, 1);
        let mut chain = Chain::default();
        pc.register(&mut chain, &p, &cells(0, 50));
        assert_eq!(chain.blocks.len(), 3);
        assert!(chain.blocks.iter().all(|&(_, owned)| owned));
        pc.release(chain, Some((&p, &cells(0, 50))));
        assert_eq!(pc.blocks(), 4, "3 blocks and the 2-token tail");
        assert_eq!(pc.take_pending().0, cells(0, 50));
        // A prompt that goes on: 3 blocks and the tail.
        let mut longer = p.clone();
        longer.extend([1, 2, 3]);
        let hit = pc.lookup(&longer, false, 1);
        assert_eq!(hit.cells, cells(0, 50));
        assert!(hit.chain.partial.is_some());
        // Exactly 48 tokens: the last one is computed, the rest comes from
        // the third block's first 15.
        assert_eq!(pc.lookup(&p[..48], false, 1).cells, cells(0, 47));
        // 49 tokens: 3 blocks, token 48 computed.
        let hit3 = pc.lookup(&p[..49], false, 1);
        assert_eq!(hit3.cells, cells(0, 48));
        assert!(hit3.chain.partial.is_none());
        // Another first token misses.
        assert!(pc.lookup(&toks(40, 2), false, 1).cells.is_empty());
        // A different token 20: the first block, and 4 of the second.
        let mut other = p.clone();
        other[20] = 9999;
        assert_eq!(pc.lookup(&other, false, 1).cells, cells(0, 20));
        // The same prompt again, cut as llama-server cuts a sliding-window
        // model's (its last 4 tokens one step): they are computed again.
        assert_eq!(pc.lookup(&p, false, 4).cells, cells(0, 46));
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
        pc.release(ca, None);
        let (retain, evict) = pc.take_pending();
        assert_eq!(retain, cells(0, 32));
        assert!(evict.is_empty());
        pc.release(cb, None);
        assert_eq!(pc.retained_cells(), 64);
        pc.take_pending();
        // A hit on a's first block makes it newer than b's blocks.
        let hit = pc.lookup(&a[..17], false, 1);
        assert_eq!(hit.cells, cells(0, 16));
        // Referenced blocks never go; a's second block is a leaf and the
        // oldest unreferenced: it goes first, then b's leaf, then b's root.
        assert_eq!(pc.shrink_to(0), 3);
        let (_, evict) = pc.take_pending();
        assert_eq!(evict[..16], cells(16, 16)[..]);
        assert_eq!(evict[16..32], cells(48, 16)[..]);
        assert_eq!(evict[32..], cells(32, 16)[..]);
        assert_eq!(pc.retained_cells(), 16);
        pc.release(hit.chain, None);
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
        pc.release(c2, Some((&p, &cells(100, 40))));
        let (retain, _) = pc.take_pending();
        assert_eq!(retain, cells(132, 8), "only the tail is new");
        pc.release(c1, Some((&p, &cells(0, 40))));
        assert_eq!(pc.take_pending().0, cells(0, 32), "c1's tail is c2's");
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
        let held = pc.lookup(&toks(33, 0), false, 1);
        for c in chains {
            pc.release(c, None);
        }
        // 96 retained; 32 referenced by `held`; 64 idle, 32 over the bound.
        assert_eq!(pc.enforce_bound(), 2);
        assert_eq!(pc.retained_cells(), 64);
        pc.release(held.chain, None);
        assert_eq!(pc.enforce_bound(), 2);
        assert_eq!(pc.retained_cells(), 32);
    }

    #[test]
    fn a_parent_goes_only_after_its_children() {
        let mut pc = PrefixCache::new(0);
        run(&mut pc, &toks(70, 5), &cells(0, 70));
        pc.take_pending();
        pc.enforce_bound();
        let (_, evict) = pc.take_pending();
        let order: Vec<i64> = [64..70, 48..64, 32..48, 16..32, 0..16]
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(evict, order, "the tail first");
        assert_eq!(pc.clear(), 0);
    }

    #[test]
    fn a_cell_in_two_kept_blocks_goes_with_the_last_of_them() {
        let mut pc = PrefixCache::new(1000);
        let p = toks(32, 1);
        run(&mut pc, &p, &cells(0, 32));
        pc.take_pending();
        // q shares p's first 20 tokens: the first block, then 4 cells of
        // the second, which q's own second block holds too.
        let mut q = p[..20].to_vec();
        q.extend(toks(12, 900));
        let hit = pc.lookup(&q, false, 1);
        assert_eq!(hit.cells, cells(0, 20));
        let mut chain = hit.chain;
        let mut q_cells = hit.cells;
        q_cells.extend(cells(200, 12));
        pc.register(&mut chain, &q, &q_cells);
        assert_eq!(pc.shrink_to(0), 0, "q references both of p's blocks");
        pc.release(chain, Some((&q, &q_cells)));
        let (retain, evict) = pc.take_pending();
        assert_eq!(retain, cells(200, 12), "16..20 were kept already");
        assert!(evict.is_empty());
        assert_eq!(pc.retained_cells(), 44);
        // p's second block is the older leaf: it goes, but 16..20 stay.
        assert_eq!(pc.shrink_to(32), 1);
        assert_eq!(pc.take_pending().1, cells(20, 12));
        assert_eq!(pc.shrink_to(16), 1);
        let mut gone = cells(16, 4);
        gone.extend(cells(200, 12));
        assert_eq!(pc.take_pending().1, gone);
    }

    #[test]
    fn a_cell_kept_and_let_go_before_a_step_is_never_flagged() {
        let mut pc = PrefixCache::new(0);
        run(&mut pc, &toks(40, 4), &cells(0, 40));
        assert!(pc.has_pending());
        assert_eq!(pc.enforce_bound(), 3);
        assert_eq!(pc.take_pending(), (vec![], vec![]));
    }

    #[test]
    fn deterministic_sequences_share_only_with_each_other() {
        let mut pc = PrefixCache::new(1000);
        let p = toks(40, 8);
        let mut chain = Chain::new(true);
        pc.register(&mut chain, &p, &cells(0, 40));
        pc.release(chain, Some((&p, &cells(0, 40))));
        assert!(pc.lookup(&p, false, 1).cells.is_empty());
        assert_eq!(pc.lookup(&p, true, 1).cells, cells(0, 39));
        run(&mut pc, &p, &cells(100, 40));
        assert_eq!(pc.lookup(&p, false, 1).cells, cells(100, 39));
        assert_eq!(pc.blocks(), 6);
    }

    #[test]
    fn a_sequence_whose_blocks_are_not_registered_keeps_no_tail() {
        let mut pc = PrefixCache::new(1000);
        let p = toks(40, 6);
        pc.release(Chain::default(), Some((&p, &cells(0, 40))));
        assert_eq!(pc.blocks(), 0);
        assert!(pc.take_pending().0.is_empty());
    }
}
