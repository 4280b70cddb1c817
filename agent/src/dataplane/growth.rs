//! Capacity that follows the cluster: the service and backend maps are sized from what
//! the first full list needs and grown live when they fill up, up to the `--max-*`
//! bounds.
//!
//! BPF hash maps cannot be resized. Growing builds a new generation of the maps whose
//! size depends on the capacity (services, backends, members, connection counts, Maglev
//! tables, source ranges), fills it with exactly what the current generation holds (the
//! same ids, so the socket state that refers to them stays right), swaps every program
//! behind its pinned link to the new maps, and removes the old ones. The maps whose size
//! does not depend on the capacity (conntrack, reverse NAT, affinity, counters, SNAT
//! addresses, meta) are the very same map objects before and after.
//!
//! [`target`] is the policy (pure); [`grow`] does it.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use aya::Ebpf;
use tracing::info;

use super::{
    KernelMaps,
    external::{ExternalContent, ExternalPlan},
    loader::{self, BpfLogger, LoadOptions, LoaderError},
    plan::{Capacity, MapContent, footprint},
};
use crate::model::ServicePortState;

/// A map is grown once its planned entries pass this share of its capacity (percent).
pub const GROW_AT_PERCENT: u64 = 80;

/// The smallest capacity the maps get (service-map entries; backends the same), unless
/// a `--max-*` bound is smaller.
pub const FLOOR: u32 = 4096;

/// [`FLOOR`], or `FERRY_CAPACITY_FLOOR` when set: a rehearsal knob that lets a test start
/// from a few entries and watch the maps grow many times.
pub fn floor() -> u32 {
    std::env::var("FERRY_CAPACITY_FLOOR")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|v| *v > 0)
        .unwrap_or(FLOOR)
}

/// The capacity for `need` entries: room for half as much again, rounded up to a power of
/// two (so the fill after growing is 33-67 %, below [`GROW_AT_PERCENT`]), at least
/// `floor`, at most `bound`.
pub fn sized_for(need: u32, floor: u32, bound: u32) -> u32 {
    let want = u64::from(need) + u64::from(need) / 2;
    let pow = want.max(1).next_power_of_two();
    pow.max(u64::from(floor)).min(u64::from(bound)) as u32
}

/// The initial capacity: `floor` within the bounds (the first sync sizes the maps).
pub fn initial(floor: u32, bound: Capacity) -> Capacity {
    Capacity {
        services: floor.min(bound.services),
        backends: floor.min(bound.backends),
    }
}

fn over_threshold(need: u32, cap: u32) -> bool {
    u64::from(need) * 100 > u64::from(cap) * GROW_AT_PERCENT
}

/// The capacity to grow to when `need` (entries the maps must hold) passes the threshold
/// of `current` in some map and the bound leaves room; `None` otherwise. A map that does
/// not need to grow keeps its size.
pub fn target(current: Capacity, need: Capacity, floor: u32, bound: Capacity) -> Option<Capacity> {
    let one = |need: u32, cap: u32, bound: u32| {
        if over_threshold(need, cap) && cap < bound {
            sized_for(need, floor, bound).max(cap)
        } else {
            cap
        }
    };
    let next = Capacity {
        services: one(need.services, current.services, bound.services),
        backends: one(need.backends, current.backends, bound.backends),
    };
    (next != current).then_some(next)
}

/// What ServicePorts need: service-map entries, and distinct backends. For a whole
/// desired state (the first sync) that is what the maps must hold; for those that did
/// not fit, what must be added to what is programmed (backends they share with it are
/// counted again: growing a little early is fine).
pub fn need_of<'a>(desired: impl IntoIterator<Item = &'a ServicePortState>) -> Capacity {
    let mut entries = 0u32;
    let mut backends = HashSet::new();
    for sp in desired {
        let (n, tuples) = footprint(sp);
        entries = entries.saturating_add(n);
        backends.extend(tuples);
    }
    Capacity {
        services: entries,
        backends: backends.len() as u32,
    }
}

/// A generation of the maps, filled and swapped in.
pub struct Grown {
    /// Keeps the new programs and maps open; the old object can be dropped.
    pub ebpf: Ebpf,
    pub maps: KernelMaps,
    pub logger: Option<BpfLogger>,
    pub capacity: Capacity,
    /// Entries copied (service, backend, member, tc tables).
    pub entries: usize,
    pub elapsed: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum GrowError {
    #[error(transparent)]
    Loader(#[from] LoaderError),
    #[error("reading the current maps: {0}")]
    Read(#[from] aya::maps::MapError),
    #[error("filling the new maps: {first} ({count} writes failed)")]
    Fill { first: String, count: usize },
}

/// Grows the maps to `to`: a new generation is loaded and filled with what `old` holds
/// (`content` when the caller knows it, read from `old` otherwise),
/// the programs are swapped to it (when `swap`; an agent still migrating from another
/// layout swaps later, in [`loader::attach`]) and the old maps' pins are replaced. On
/// error the old generation stays in place, untouched.
pub fn grow(
    opts: &LoadOptions,
    old: &KernelMaps,
    content: Option<&MapContent>,
    to: Capacity,
    swap: bool,
) -> Result<Grown, GrowError> {
    let started = Instant::now();
    let mut new = loader::load_generation(opts, to)?;
    let result = (|| {
        let read;
        let content = match content {
            Some(c) => c,
            None => {
                read = old.read()?;
                &read
            }
        };
        let external = old.read_external()?;
        let report = new.maps.fill(content, &upserts(external));
        if let Some(first) = report.failures.first() {
            return Err(GrowError::Fill {
                first: first.clone(),
                count: report.failures.len(),
            });
        }
        // Per-ServicePort connection counts, so the counters go on (what the old
        // programs count between this copy and the swap is lost).
        old.carry_service_connections(&mut new.maps);
        Ok(report.writes)
    })();
    let entries = match result {
        Ok(n) => n,
        Err(e) => {
            loader::discard_generation(&new.pending);
            return Err(e);
        }
    };
    loader::commit_generation(&mut new.ebpf, &new.pending, swap)?;
    let elapsed = started.elapsed();
    info!(
        services = to.services,
        backends = to.backends,
        entries,
        elapsed_ms = elapsed.as_millis() as u64,
        "maps grown: new generation filled, programs swapped, old maps removed"
    );
    Ok(Grown {
        ebpf: new.ebpf,
        maps: new.maps,
        logger: new.logger,
        capacity: to,
        entries,
        elapsed,
    })
}

/// Writes for every tc table and range in `c` (into empty maps).
fn upserts(c: ExternalContent) -> ExternalPlan {
    ExternalPlan {
        maglev_upserts: c.maglev.into_iter().collect(),
        range_upserts: c.ranges.into_iter().collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(services: u32, backends: u32) -> Capacity {
        Capacity { services, backends }
    }

    #[test]
    fn sizes_are_powers_of_two_with_half_again_within_floor_and_bound() {
        assert_eq!(sized_for(0, 4096, 1 << 20), 4096);
        assert_eq!(sized_for(10, 64, 1 << 20), 64);
        assert_eq!(sized_for(3000, 64, 1 << 20), 8192, "4500 -> 8192");
        assert_eq!(sized_for(5000, 64, 1 << 20), 8192, "7500 -> 8192");
        assert_eq!(sized_for(6000, 64, 1 << 20), 16384, "9000 -> 16384");
        // 30,000 Services x 4 endpoints: 150,000 service-map entries.
        assert_eq!(sized_for(150_000, 4096, 1 << 20), 262_144);
        assert_eq!(sized_for(900_000, 4096, 1 << 20), 1 << 20, "the bound wins");
        assert_eq!(sized_for(10, 4096, 3), 3, "a bound below the floor wins");
        assert_eq!(sized_for(u32::MAX, 1, u32::MAX), u32::MAX);
    }

    #[test]
    fn grows_past_the_threshold_only_and_never_beyond_the_bound() {
        let bound = cap(1 << 20, 1 << 20);
        assert_eq!(target(cap(64, 64), cap(51, 10), 64, bound), None, "80 %");
        assert_eq!(
            target(cap(64, 64), cap(52, 10), 64, bound),
            Some(cap(128, 64)),
            "over 80 %: the service map doubles, the backend map stays"
        );
        assert_eq!(
            target(cap(64, 64), cap(1000, 900), 64, bound),
            Some(cap(2048, 2048)),
            "one step to the need, not doubling after doubling"
        );
        let small = cap(100, 50);
        assert_eq!(target(small, cap(99, 10), 64, small), None, "at the bound");
        assert_eq!(
            target(cap(64, 50), cap(90, 49), 64, small),
            Some(cap(100, 50)),
            "up to the bound, not past it"
        );
    }
}
