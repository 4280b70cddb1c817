//! The dataplane: the only code that touches BPF programs and maps.
//!
//! - [`plan`] (pure) turns the model's [`crate::model::DesiredState`] into map content and
//!   an ordered list of writes against what the kernel holds now;
//! - [`kernel`] reads and writes the pinned maps;
//! - [`loader`] loads the programs, pins maps and links, and swaps programs in place;
//! - [`growth`] sizes the maps from what they must hold and grows them live;
//! - [`bpf_sys`] holds the few raw `bpf(2)` calls aya 0.14 does not expose.

pub mod bpf_sys;
pub mod ext_maps;
pub mod external;
pub mod growth;
pub mod kernel;
pub mod loader;
pub mod maglev;
pub mod plan;
pub mod programmed;
pub mod snat;
pub mod sockdiag;
pub mod tc;

pub use kernel::KernelMaps;
pub use loader::{LoadOptions, attach, cleanup, load};
pub use plan::{Capacity, Ids, MapContent, Plan, PlanError};
pub use programmed::Programmed;
