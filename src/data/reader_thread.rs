//! The one place that starts a thread feeding a bounded queue: the training loader's workers, the
//! evaluation reader and `align data build`'s input all read shards (or files) on a thread of
//! their own and hand items over through a queue of a few items, so that reading overlaps the
//! consumer's work and memory stays bounded. The producer sees a send fail once the receiver is
//! dropped, and stops.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

/// Starts `produce` on a thread named `name` with a queue of `capacity` items (at least one).
pub fn spawn<T: Send + 'static>(
    name: &str,
    capacity: usize,
    produce: impl FnOnce(SyncSender<T>) + Send + 'static,
) -> std::io::Result<(Receiver<T>, JoinHandle<()>)> {
    let (tx, rx) = sync_channel(capacity.max(1));
    let handle = std::thread::Builder::new().name(name.to_string()).spawn(move || produce(tx))?;
    Ok((rx, handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_arrive_in_order_and_a_dropped_receiver_stops_the_producer() {
        let (rx, handle) = spawn("test-reader", 2, |tx| {
            for i in 0..5 {
                tx.send(i).unwrap();
            }
        })
        .unwrap();
        assert_eq!(rx.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        handle.join().unwrap();
        // An endless producer ends once nobody listens.
        let (rx, handle) = spawn("endless", 1, |tx| {
            for i in 0u64.. {
                if tx.send(i).is_err() {
                    return;
                }
            }
        })
        .unwrap();
        assert_eq!(rx.recv().unwrap(), 0);
        drop(rx);
        handle.join().unwrap();
    }
}
