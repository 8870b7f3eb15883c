//! A silent `pipe:` shard is abandoned after `data.stall_timeout_s`. The stall timeout is one
//! setting for the whole process, so this test has a test binary of its own: another test
//! training at the same time would set it back to its default of 300 s.

mod common;

use std::time::{Duration, Instant};

/// A shard source that never sends a byte, beside good shards: training goes on, the source is
/// abandoned after `data.stall_timeout_s` and counted as a skip.
#[test]
fn a_silent_pipe_shard_is_abandoned_and_training_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let spec = format!("{}::pipe:sleep 600", data.train);
    let cfg = common::tiny_config(
        &data,
        &tok,
        &dir.path().join("runs"),
        &[&format!("data.train={spec}"), "data.stall_timeout_s=1", "train.steps=6"],
    );
    let started = Instant::now();
    let s = align::train::trainer::train(&cfg, &common::cpu_options()).unwrap();
    assert_eq!(s.steps, 6);
    assert!(s.skipped.get("truncated_shard") >= 1, "{}", s.skipped.summary());
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
}
