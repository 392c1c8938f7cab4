#![doc = include_str!("../README.md")]

pub mod backends;
pub mod http;
pub mod isolated;
pub mod names;
pub mod nats_streams;
pub mod plans;
pub mod ports;
mod process;
pub mod redis_keys;
pub mod scratch_cluster;
pub mod scratch_mariadb;
pub mod scratch_nats;
pub mod scratch_postgres;
pub mod scratch_redis;
pub mod scratch_sentinel;
pub mod secrets;
pub mod services;
pub mod stoppable;
pub mod wait;

pub use http::{HttpResponse, http_get};
pub use isolated::{Engine, Isolated, MariadbUser, mariadb, psql};
pub use names::{unique, unique_prefix};
pub use nats_streams::DropStreams;
pub use redis_keys::{delete_keys_quietly, delete_redis_keys, redis_conn};
pub use scratch_cluster::ScratchCluster;
pub use scratch_mariadb::ScratchMariadb;
pub use scratch_nats::ScratchNats;
pub use scratch_postgres::ScratchPostgres;
pub use scratch_redis::{PasswordRedis, ScratchRedis};
pub use scratch_sentinel::ScratchSentinel;
pub use secrets::assert_hidden;
pub use services::{database_url, mysql_url, nats_url, redis_url};
pub use stoppable::{Shutdown, Stoppable, spawn_until};
pub use wait::{
    PATIENCE, eventually, eventually_within, until_some, wait_until, wait_until_explained,
    wait_until_within,
};
