//! How long a run is, from what its recipe states: `train.steps`, or `train.epochs` over
//! `train.samples_per_epoch` (open_clip's `--epochs` with `--train-num-samples`; counted from the
//! shards when not given), or `train.samples` (pairs seen in all). The steps they imply are
//! printed and replace them in the run's config, so the saved `config.toml` states the steps and
//! a resumed run compares steps as it always has.

use anyhow::{Context, Result};
use rayon::prelude::*;

use crate::config::Config;
use crate::data::spec;
use crate::data::tar_read::{read_shard_events, ShardEvent};
use crate::util::log;
use crate::util::progress::Progress;

/// Samples in the shards of `spec`: each tar's samples, decoding nothing.
pub fn count_samples(spec_text: &str, quiet: bool) -> Result<u64> {
    let shards = spec::expand(spec_text).with_context(|| format!("counting the samples of {spec_text}"))?;
    let bar = Progress::bar(shards.len() as u64, "counting samples", quiet);
    let n = shards
        .par_iter()
        .map(|s| {
            let n = read_shard_events(s).iter().filter(|e| matches!(e, ShardEvent::Sample(_))).count() as u64;
            bar.inc(1);
            n
        })
        .sum();
    bar.finish();
    Ok(n)
}

/// Replaces `train.epochs` or `train.samples` by the steps they imply at `train.batch_size` (with
/// token-budget batches, at their mean over the lengths on `world` ranks).
pub fn resolve(cfg: &mut Config, world: usize, quiet: bool) -> Result<()> {
    let t = &cfg.train;
    if t.epochs == 0.0 && t.samples == 0 {
        return Ok(());
    }
    let ranks = (world.max(1) * t.accum_steps.max(1)) as f64;
    let batch = match crate::data::token_budget::TokenBudget::of(
        &cfg.data.naflex_seq_lens,
        cfg.data.naflex_batch_divisor,
        (t.batch_size as f64 / ranks) as usize,
    ) {
        Some(b) => b.mean_batch() * ranks,
        None => t.batch_size as f64,
    };
    let (samples, how) = if t.samples > 0 {
        (t.samples as f64, format!("train.samples = {}", t.samples))
    } else {
        let per_epoch = if t.samples_per_epoch > 0 {
            t.samples_per_epoch
        } else {
            let n = count_samples(&cfg.data.train, quiet)?;
            anyhow::ensure!(n > 0, "train.epochs: {} holds no samples", cfg.data.train);
            n
        };
        (t.epochs * per_epoch as f64, format!("train.epochs = {} of {per_epoch} samples", t.epochs))
    };
    let steps = ((samples / batch).ceil() as u64).max(1);
    if !quiet {
        let mean = if cfg.data.naflex_seq_lens.is_empty() { "" } else { "token-budget batches of a mean " };
        log::info(format!("{how} at a global batch of {mean}{batch} pairs: train.steps = {steps}"));
    }
    cfg.train.steps = steps;
    cfg.train.epochs = 0.0;
    cfg.train.samples = 0;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &[&str]) -> Result<Config> {
        Config::from_str_with_overrides("", "x.toml", &extra.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn epochs_and_samples_become_steps() {
        let mut c = cfg(&["train.batch_size=1024", "train.epochs=2.5", "train.samples_per_epoch=10000"]).unwrap();
        resolve(&mut c, 1, true).unwrap();
        // 25,000 pairs at 1,024 a step: 24.4, so 25 steps.
        assert_eq!((c.train.steps, c.train.epochs, c.train.samples), (25, 0.0, 0));
        let mut c = cfg(&["train.batch_size=1000", "train.samples=128000000"]).unwrap();
        resolve(&mut c, 1, true).unwrap();
        assert_eq!(c.train.steps, 128_000);
        let mut c = cfg(&["train.steps=7"]).unwrap();
        resolve(&mut c, 1, true).unwrap();
        assert_eq!(c.train.steps, 7);
    }

    /// Token-budget batches: 2 ranks × 8 images at the longest of [16, 64] patches, 32 at 16
    /// patches, a mean global batch of 2 · (32 + 8) / 2 = 40 pairs; 1,000 pairs take 25 steps.
    #[test]
    fn token_budget_epochs_count_at_the_mean_batch() {
        let mut c =
            cfg(&["train.batch_size=16", "train.samples=1000", "data.naflex_seq_lens=[16, 64]", "data.naflex_batch_divisor=1"]).unwrap();
        resolve(&mut c, 2, true).unwrap();
        assert_eq!(c.train.steps, 25);
    }

    #[test]
    fn epochs_over_shards_count_their_samples() {
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::data::synth::SynthSpec { train_shards: 3, samples_per_shard: 10, test_samples: 2, image_size: 8, seed: 1 };
        let data = crate::data::synth::write_synth(dir.path(), &spec).unwrap();
        assert_eq!(count_samples(&data.train, true).unwrap(), 30);
        let mut c = cfg(&[&format!("data.train={}", data.train), "train.batch_size=8", "train.epochs=2"]).unwrap();
        resolve(&mut c, 1, true).unwrap();
        assert_eq!(c.train.steps, 8, "60 pairs at 8 a step");
    }

    #[test]
    fn one_length_at_a_time() {
        for (extra, why) in [
            (&["train.steps=10", "train.epochs=1"][..], "train.steps"),
            (&["train.epochs=1", "train.samples=100"][..], "one of"),
            (&["train.epochs=-1"][..], "train.epochs"),
        ] {
            let e = format!("{:#}", cfg(extra).unwrap_err());
            assert!(e.contains(why), "{extra:?}: {e}");
        }
    }
}
