//! Full B-tree nodes for maps filled entry by entry.
//!
//! A `BTreeMap` filled in key order keeps its nodes about half full (a full node splits
//! 6 / 5 and only the right half fills further), at random about two-thirds full. One
//! merged from two maps with `append` is built from a sorted stream with full nodes,
//! and the merge frees the old nodes as it goes, so compacting needs no copy of the map.

use std::collections::{BTreeMap, BTreeSet};

/// Rebuilds `map` with full nodes: split at the middle key, merged back with `append`.
pub fn compact<K: Ord + Clone, V>(map: &mut BTreeMap<K, V>) {
    let Some(mid) = map.keys().nth(map.len() / 2).cloned() else {
        return;
    };
    let mut right = map.split_off(&mid);
    // `append` swaps instead of merging when either side is empty.
    if !map.is_empty() {
        map.append(&mut right);
    } else {
        *map = right;
    }
}

/// A B-tree collection [`Chunked`] can build: made from a chunk of items, and merged.
pub trait Sorted: Default + FromIterator<Self::Item> {
    type Item;
    /// Moves every item of `other` in (`BTreeMap::append`).
    fn merge(&mut self, other: &mut Self);
    fn count(&self) -> usize;
}

impl<K: Ord, V> Sorted for BTreeMap<K, V> {
    type Item = (K, V);
    fn merge(&mut self, other: &mut Self) {
        self.append(other);
    }
    fn count(&self) -> usize {
        self.len()
    }
}

impl<K: Ord> Sorted for BTreeSet<K> {
    type Item = K;
    fn merge(&mut self, other: &mut Self) {
        self.append(other);
    }
    fn count(&self) -> usize {
        self.len()
    }
}

/// Items per sorted chunk.
const CHUNK: usize = 16 * 1024;

/// A B-tree built from items in any order, in sorted chunks: each chunk is sorted into a
/// small tree and merged into the whole (which frees the old nodes as it goes), so the
/// result has full nodes and building it adds about one chunk. Collecting everything
/// into a list first (what `FromIterator` does) holds the list, a sort buffer as large
/// and the tree at once: 24 MiB for the 100,000 ServicePorts' owners at 100000x4.
pub struct Chunked<C: Sorted> {
    pub done: C,
    chunk: Vec<C::Item>,
}

impl<C: Sorted> Default for Chunked<C> {
    fn default() -> Self {
        Chunked {
            done: C::default(),
            chunk: Vec::new(),
        }
    }
}

impl<C: Sorted> Chunked<C> {
    /// Adds an item; true when that merged the chunk.
    pub fn push(&mut self, item: C::Item) -> bool {
        if self.chunk.capacity() == 0 {
            self.chunk.reserve_exact(CHUNK);
        }
        self.chunk.push(item);
        let full = self.chunk.len() == CHUNK;
        if full {
            self.flush();
        }
        full
    }

    /// Merges the chunk in. `collect` (a stable sort) and `append` both keep the last
    /// value written per key, as `insert` does.
    fn flush(&mut self) {
        let mut chunk: C = std::mem::take(&mut self.chunk).into_iter().collect();
        self.done.merge(&mut chunk);
    }

    /// Items so far (a key written twice in the current chunk counts twice).
    pub fn len(&self) -> usize {
        self.done.count() + self.chunk.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn build(mut self) -> C {
        self.flush();
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_build_the_same_tree_as_collect() {
        let n = 3 * CHUNK + 17;
        let items: Vec<(u32, u32)> = (0..n as u32).map(|i| (i * 7919 % 65_521, i)).collect();
        let mut c: Chunked<BTreeMap<u32, u32>> = Chunked::default();
        let mut merged = 0;
        for it in &items {
            merged += c.push(*it) as usize;
        }
        assert_eq!(merged, 3, "one merge per full chunk");
        let want: BTreeMap<u32, u32> = items.iter().copied().collect();
        assert_eq!(c.build(), want, "a key written twice keeps its last value");
        let mut s: Chunked<BTreeSet<u32>> = Chunked::default();
        for (k, _) in &items {
            s.push(*k);
        }
        let want: BTreeSet<u32> = items.iter().map(|(k, _)| *k).collect();
        assert_eq!(s.build(), want);
    }

    #[test]
    fn compacting_keeps_every_entry_in_order() {
        for n in [0usize, 1, 2, 3, 1000] {
            let mut m: BTreeMap<usize, String> = (0..n).map(|i| (i, i.to_string())).collect();
            for i in 0..n {
                m.insert(i * 7919 % (n + 1), format!("x{i}"));
            }
            let before: Vec<(usize, String)> = m.clone().into_iter().collect();
            compact(&mut m);
            let after: Vec<(usize, String)> = m.into_iter().collect();
            assert_eq!(before, after);
        }
    }
}
