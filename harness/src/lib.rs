#![doc = include_str!("../README.md")]

pub mod chaos;
pub mod ordered;
pub mod process;
