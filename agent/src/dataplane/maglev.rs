//! Maglev table population (Eisenbud et al., "Maglev: A Fast and Reliable Software
//! Network Load Balancer", NSDI 2016, §3.4).
//!
//! Each backend gets a permutation of the table's slots from two hashes of its address
//! and port (never of its node-local id), and backends take turns claiming their next
//! free preferred slot until the table is full. So every node builds the same table for
//! the same set (the ids written differ per node, the backends they name do not), each
//! backend gets `M/N` slots give or take one, and a set change moves few of the other
//! backends' slots.

use ferry_common::{
    Addr,
    ext::{MAGLEV_TABLE_SIZE, MaglevTable},
};

/// A backend as the table sees it: its identity and the id written in its slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MaglevBackend {
    /// Address as in the maps (network byte order, IPv4 mapped).
    pub addr: Addr,
    /// Port, network byte order.
    pub port_be: u16,
    /// `FERRY_BACKENDS` id on this node.
    pub id: u32,
}

/// The table for `backends` (any order; duplicates are ignored). `None` when there is
/// no backend: the frontend then drops or rejects and never reads a table.
pub fn table(backends: &[MaglevBackend]) -> Option<Box<MaglevTable>> {
    let mut sorted = backends.to_vec();
    // The turn order must not depend on ids or on input order.
    sorted.sort_by_key(|b| (b.addr, b.port_be));
    sorted.dedup_by_key(|b| (b.addr, b.port_be));
    if sorted.is_empty() {
        return None;
    }
    let m = MAGLEV_TABLE_SIZE as u64;
    let perms: Vec<(u64, u64)> = sorted
        .iter()
        .map(|b| {
            let offset = hash(0x6d61_676c_6576_3031, b) % m;
            let skip = hash(0x6d61_676c_6576_3032, b) % (m - 1) + 1;
            (offset, skip)
        })
        .collect();
    const EMPTY: usize = usize::MAX;
    let mut owner = vec![EMPTY; MAGLEV_TABLE_SIZE];
    let mut next = vec![0u64; sorted.len()];
    let mut filled = 0;
    // Terminates: the table size is prime, so each permutation visits every slot, and
    // every turn fills one slot.
    'fill: loop {
        for (i, &(offset, skip)) in perms.iter().enumerate() {
            let mut slot = ((offset + next[i] * skip) % m) as usize;
            while owner[slot] != EMPTY {
                next[i] += 1;
                slot = ((offset + next[i] * skip) % m) as usize;
            }
            owner[slot] = i;
            next[i] += 1;
            filled += 1;
            if filled == MAGLEV_TABLE_SIZE {
                break 'fill;
            }
        }
    }
    let mut out = Box::new(MaglevTable {
        backend_ids: [0; MAGLEV_TABLE_SIZE],
        _pad: 0,
    });
    for (slot, i) in owner.into_iter().enumerate() {
        out.backend_ids[slot] = sorted[i].id;
    }
    Some(out)
}

/// FNV-1a over the backend's address and port bytes (as stored: network order), then
/// splitmix64's finaliser; fixed here, so every node and every release agrees.
fn hash(seed: u64, b: &MaglevBackend) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ seed;
    let bytes = b
        .addr
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .chain(b.port_be.to_ne_bytes());
    for byte in bytes {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::dataplane::plan::addr_of;

    fn backends(n: u32, first_id: u32) -> Vec<MaglevBackend> {
        (0..n)
            .map(|i| MaglevBackend {
                addr: addr_of(&format!("10.0.{}.{}", i / 200, i % 200 + 1).parse().unwrap()),
                port_be: 8080u16.to_be(),
                id: first_id + i,
            })
            .collect()
    }

    /// Slots per backend id.
    fn counts(t: &MaglevTable) -> BTreeMap<u32, usize> {
        let mut c = BTreeMap::new();
        for id in t.backend_ids {
            *c.entry(id).or_default() += 1;
        }
        c
    }

    /// Slot -> backend (address), so tables with different ids can be compared.
    fn by_backend(t: &MaglevTable, set: &[MaglevBackend]) -> Vec<Addr> {
        t.backend_ids
            .iter()
            .map(|id| set.iter().find(|b| b.id == *id).unwrap().addr)
            .collect()
    }

    #[test]
    fn empty_set_has_no_table() {
        assert!(table(&[]).is_none());
    }

    #[test]
    fn fully_filled_and_balanced() {
        for n in [1, 2, 3, 10, 100, 1021] {
            let set = backends(n, 1);
            let t = table(&set).unwrap();
            let c = counts(&t);
            assert_eq!(c.len(), n as usize, "n={n}: every backend has slots");
            assert!(
                c.keys().all(|id| (1..=n).contains(id)),
                "n={n}: only known ids"
            );
            let (min, max) = (c.values().min().unwrap(), c.values().max().unwrap());
            assert!(max - min <= 1, "n={n}: slots per backend {min}..{max}");
        }
    }

    #[test]
    fn more_backends_than_slots_still_fills_the_table() {
        let t = table(&backends(1500, 1)).unwrap();
        assert!(t.backend_ids.iter().all(|id| *id >= 1));
        assert_eq!(counts(&t).len(), MAGLEV_TABLE_SIZE);
    }

    /// Same set, any order, any node-local ids: the same backend in every slot.
    #[test]
    fn deterministic_across_order_and_ids() {
        let a = backends(17, 1);
        let mut b = backends(17, 500);
        b.reverse();
        let (ta, tb) = (table(&a).unwrap(), table(&b).unwrap());
        assert_eq!(by_backend(&ta, &a), by_backend(&tb, &b));
        assert_eq!(table(&a).unwrap(), ta);
    }

    /// Removing or adding one backend among N moves about 1/N of the other backends'
    /// slots (the paper's minimal disruption).
    #[test]
    fn one_change_moves_few_other_slots() {
        // Within M/N while M >= 50 N; the disruption grows as M/N shrinks (paper, §5.3).
        for n in [5u32, 10, 20] {
            let set = backends(n, 1);
            let before = by_backend(&table(&set).unwrap(), &set);
            let removed = set[n as usize / 2].addr;
            let fewer: Vec<_> = set.iter().copied().filter(|b| b.addr != removed).collect();
            let after = by_backend(&table(&fewer).unwrap(), &fewer);
            let moved = before
                .iter()
                .zip(&after)
                .filter(|(b, a)| **b != removed && b != a)
                .count();
            let budget = MAGLEV_TABLE_SIZE / n as usize;
            assert!(
                moved <= budget,
                "n={n}: removal moved {moved} other slots (budget {budget})"
            );
            // Adding it back is the reverse change.
            let moved_back = after
                .iter()
                .zip(&before)
                .filter(|(a, b)| **b != removed && a != b)
                .count();
            assert_eq!(moved, moved_back);
        }
    }
}
