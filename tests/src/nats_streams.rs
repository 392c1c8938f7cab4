//! Removing a test's JetStream streams from the shared nats-server when it ends, so that
//! runs do not pile up streams there.

use futures_util::StreamExt as _;

/// Deletes, when dropped (also when the test panics), every stream on the server at
/// `url` whose name starts with `prefix`. Create it right after choosing the prefix.
pub struct DropStreams {
    url: String,
    prefix: String,
}

impl DropStreams {
    /// Streams of `prefix` on the server at `url`.
    pub fn new(url: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: prefix.into(),
        }
    }
}

impl Drop for DropStreams {
    fn drop(&mut self) {
        let (url, prefix) = (self.url.clone(), self.prefix.clone());
        // A runtime of its own on a thread of its own: the test's runtime may be
        // shutting down, or this may run inside it.
        let cleanup = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let Ok(client) = async_nats::connect(&url).await else {
                    return;
                };
                let js = async_nats::jetstream::new(client);
                let names: Vec<String> = js
                    .stream_names()
                    .filter_map(|n| async move { n.ok() })
                    .collect()
                    .await;
                for name in names.iter().filter(|n| n.starts_with(&prefix)) {
                    let _ = js.delete_stream(name).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}
