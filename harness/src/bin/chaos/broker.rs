//! The run's private broker, whichever it is (`--broker`): what the faults, the drain
//! and the checks ask of it. [`RedisServer`] and [`NatsServer`] implement it.

use std::collections::HashSet;
use std::time::Duration;

use crate::BoxError;
use crate::nats_server::NatsServer;
use crate::redis_server::RedisServer;

/// A private broker server the run starts, stops and reads.
pub(crate) trait BrokerServer {
    /// The URL the relays and the consumers are given.
    fn url(&self) -> String;
    /// Its client port (a cluster's: the node an outage takes down).
    fn port(&self) -> u16;
    /// Whether it runs (not in an outage).
    fn is_up(&self) -> bool;
    /// Starts it again on the same port and files; waits until it serves.
    fn up(&mut self) -> Result<(), BoxError>;
    /// Stops it: with SIGKILL (`crash`) or SIGTERM.
    fn down(&mut self, crash: bool) -> Result<(), BoxError>;
    /// Drops every client connection (Redis `CLIENT KILL TYPE normal`).
    fn kill_clients(&self) -> Result<u64, BoxError>;
    /// Every message of `stream` in stream order: `(its position, msg_id)`.
    fn read_stream(&self, stream: &str) -> Result<Vec<(String, String)>, BoxError>;
    /// The consumer names (Redis) or connection names (NATS) that read within `window`.
    fn readers(&self, window: Duration) -> Result<HashSet<String>, BoxError>;
    /// Messages in `stream`; `<stream>:dead` is its dead letters.
    fn len(&self, stream: &str) -> Result<u64, BoxError>;
    /// The consumer names holding an ordered-mode lease of the run's group on one of
    /// `streams` (Redis). NATS keeps no such lease the run can read: an error, so that
    /// a check that asks stays strict.
    fn lease_holders(&self, _streams: &[String]) -> Result<HashSet<String>, BoxError> {
        Err("no ordered-mode leases the run can read on this broker".into())
    }
}

impl BrokerServer for RedisServer {
    fn url(&self) -> String {
        RedisServer::url(self)
    }
    fn port(&self) -> u16 {
        RedisServer::port(self)
    }
    fn is_up(&self) -> bool {
        RedisServer::is_up(self)
    }
    fn up(&mut self) -> Result<(), BoxError> {
        RedisServer::up(self)
    }
    fn down(&mut self, crash: bool) -> Result<(), BoxError> {
        RedisServer::down(self, crash)
    }
    fn kill_clients(&self) -> Result<u64, BoxError> {
        RedisServer::kill_clients(self)
    }
    fn read_stream(&self, stream: &str) -> Result<Vec<(String, String)>, BoxError> {
        RedisServer::read_stream(self, stream)
    }
    fn readers(&self, window: Duration) -> Result<HashSet<String>, BoxError> {
        RedisServer::readers(self, window)
    }
    fn len(&self, stream: &str) -> Result<u64, BoxError> {
        RedisServer::len(self, stream)
    }
    fn lease_holders(&self, streams: &[String]) -> Result<HashSet<String>, BoxError> {
        RedisServer::lease_holders(self, streams, crate::GROUP)
    }
}

impl BrokerServer for NatsServer {
    fn url(&self) -> String {
        NatsServer::url(self)
    }
    fn port(&self) -> u16 {
        NatsServer::port(self)
    }
    fn is_up(&self) -> bool {
        NatsServer::is_up(self)
    }
    fn up(&mut self) -> Result<(), BoxError> {
        NatsServer::up(self)
    }
    fn down(&mut self, crash: bool) -> Result<(), BoxError> {
        NatsServer::down(self, crash)
    }
    fn kill_clients(&self) -> Result<u64, BoxError> {
        Err(
            "nats-server 2.9 cannot drop its clients (no kick): the plan has no \
             client_kill on NATS"
                .into(),
        )
    }
    fn read_stream(&self, stream: &str) -> Result<Vec<(String, String)>, BoxError> {
        NatsServer::read_stream(self, stream)
    }
    fn readers(&self, window: Duration) -> Result<HashSet<String>, BoxError> {
        NatsServer::readers(self, window)
    }
    fn len(&self, stream: &str) -> Result<u64, BoxError> {
        NatsServer::len(self, stream)
    }
}
