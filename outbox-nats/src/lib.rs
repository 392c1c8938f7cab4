#![doc = include_str!("../README.md")]
#![doc(test(attr(deny(warnings))))]

mod error;

pub use error::{Error, Result};

/// The async-nats crate, for the types this API names.
pub use async_nats;
