//! Full B-tree nodes for maps filled entry by entry.
//!
//! A `BTreeMap` filled in key order keeps its nodes about half full (a full node splits
//! 6 / 5 and only the right half fills further), at random about two-thirds full. One
//! merged from two maps with `append` is built from a sorted stream with full nodes,
//! and the merge frees the old nodes as it goes, so compacting needs no copy of the map.

use std::collections::BTreeMap;

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

#[cfg(test)]
mod tests {
    use super::*;

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
