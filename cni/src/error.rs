//! The CNI error result: a code from the specification (or ferry's own, 100 and up), a
//! short message and details that name what failed.

use std::fmt;

/// 1: the configuration's `cniVersion` is not one this plugin speaks.
pub const INCOMPATIBLE_VERSION: u32 = 1;
/// 2: a field of the configuration is not supported (the message names key and value).
pub const UNSUPPORTED_FIELD: u32 = 2;
/// 3: the container (its network namespace) does not exist.
pub const UNKNOWN_CONTAINER: u32 = 3;
/// 4: a `CNI_*` environment variable is missing or invalid.
pub const INVALID_ENV: u32 = 4;
/// 5: reading the configuration from stdin failed.
pub const IO_FAILURE: u32 = 5;
/// 6: the configuration is not JSON of the expected shape.
pub const DECODE_FAILURE: u32 = 6;
/// 7: the configuration is JSON but invalid (a bad CIDR, MTU, name...).
pub const INVALID_CONFIG: u32 = 7;
/// 11: a transient condition; the runtime should retry.
pub const TRY_AGAIN: u32 = 11;
/// 50: STATUS: the plugin cannot serve ADD now.
pub const NOT_AVAILABLE: u32 = 50;
/// 100: no free address left in a pod CIDR (the message names it).
pub const EXHAUSTED: u32 = 100;
/// 101: the IPAM store (data directory) could not be read or written.
pub const STORE_FAILURE: u32 = 101;
/// 102: a netlink operation (interface, address, route) failed.
pub const NETLINK_FAILURE: u32 = 102;
/// 103: CHECK found the attachment not as ADD left it.
pub const CHECK_FAILED: u32 = 103;
/// 104: GC could not remove everything stale (the details list what remains).
pub const GC_INCOMPLETE: u32 = 104;

/// An error as the CNI specification's error result carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl Error {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Error {
        Error {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    pub fn env(var: &str, details: impl Into<String>) -> Error {
        Error::new(
            INVALID_ENV,
            format!("invalid environment variable {var}"),
            details,
        )
    }

    pub fn config(details: impl Into<String>) -> Error {
        Error::new(INVALID_CONFIG, "invalid network configuration", details)
    }

    pub fn store(details: impl Into<String>) -> Error {
        Error::new(STORE_FAILURE, "IPAM store failure", details)
    }

    pub fn netlink(details: impl Into<String>) -> Error {
        Error::new(NETLINK_FAILURE, "interface setup failed", details)
    }

    pub fn check(details: impl Into<String>) -> Error {
        Error::new(CHECK_FAILED, "attachment is not as ADD left it", details)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code {}): {}", self.msg, self.code, self.details)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
