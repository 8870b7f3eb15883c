//! The training loader: shards → samples → shuffle buffer → decode + augment + tokenise → batches,
//! on worker threads, with a position that can be saved and restored exactly.
//!
//! Stages, in order, each its own small piece:
//! 1. [`ShardPlan`] deals the epoch's shards to this rank's workers (or resamples them).
//! 2. Each worker streams its shards with [`read_shard`] into a seeded [`ShuffleBuffer`].
//! 3. Samples leaving the buffer are decoded, augmented ([`train_transform`]) and tokenised
//!    straight into the worker's batch buffers by a [`BatchBuilder`].
//! 4. Full batches go into the worker's bounded queue (`reader_thread`); the main thread takes
//!    batches from the workers round-robin, skipping workers that finished the current epoch.
//!
//! ## Resumption guarantee
//! Every random choice is a pure function of (seed, rank, worker, epoch, position), and each batch
//! carries the state of its worker right after the batch was formed: epoch, shard cursor, next
//! sample index in that shard, the identities of the samples in the shuffle buffer (in order) and
//! the shuffle draw counter. [`LoaderPosition`] holds that state for the last batch *consumed* from
//! each worker plus the round-robin bookkeeping. A loader restarted from a position produces
//! exactly the batches the original would have produced next (same worker count and seed): a
//! restored worker re-reads the shards its buffered samples came from (tar parsing only, no
//! decoding; at most a buffer's worth of samples back) to refill its buffer, then continues.
//!
//! A worker's last partial batch of an epoch is completed with the first samples of its next epoch,
//! so no sample is dropped.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

pub use super::batch::Batch;
use super::batch::BatchBuilder;
use super::distribute::{Placement, ShardPlan};
use super::sample;
use super::shuffle::ShuffleBuffer;
use super::skips::SkipCounts;
use super::tar_read::{read_shard, RawSample, ShardEvent};
use super::teacher_feed::{StreamAt, TeacherFeed, TeacherSide};
use super::token_budget::TokenBudget;
use super::tokenizer::TextTokenizer;
use super::transform::{decode, decode_min_side, train_transform, ImageConfig};
use crate::util::log;
use crate::util::rng::Rng;
use crate::util::threads::LoaderAtWork;

/// A worker's progress, as of the end of a batch it produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct WorkerState {
    pub epoch: u64,
    /// Position in this worker's shard stream for `epoch`.
    pub cursor: usize,
    /// Next sample index to read in shard `cursor`.
    pub next_index: u64,
    /// `(cursor, index)` of each sample in the shuffle buffer, in buffer order.
    pub buffer: Vec<(usize, u64)>,
    /// Number of random draws the shuffle buffer has made this epoch.
    pub pops: u64,
    /// Samples emitted into batches, all epochs.
    pub samples: u64,
    /// Samples emitted into batches in `epoch`, so that an epoch resumed after its last batch
    /// still reports what it produced; None in a state saved before this was recorded.
    #[serde(default)]
    pub epoch_samples: Option<u64>,
    /// Batches this worker has formed, all epochs (a token-budget batch's length is drawn from
    /// it).
    #[serde(default)]
    pub batches: u64,
    /// Samples emitted into batches, all epochs, by the `::` source of `data.train` they came
    /// from (index: source).
    #[serde(default)]
    pub source_samples: Vec<u64>,
    pub skips: SkipCounts,
}

impl WorkerState {
    fn fresh() -> Self {
        WorkerState { epoch_samples: Some(0), ..Default::default() }
    }
}

/// The whole loader's position: what to save in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    pub epoch: u64,
    pub next_worker: usize,
    pub exhausted: Vec<bool>,
    pub workers: Vec<WorkerState>,
    pub batches: u64,
    /// Samples the workers reported at the ends of `epoch` received so far; None where a
    /// position saved before this was recorded leaves it unknown.
    #[serde(default)]
    pub epoch_samples: Option<u64>,
    /// Epoch ends received for `epoch`.
    #[serde(default)]
    pub epoch_ends: usize,
}

impl LoaderPosition {
    pub fn fresh(workers: usize) -> Self {
        LoaderPosition {
            epoch: 0,
            next_worker: 0,
            exhausted: vec![false; workers],
            workers: vec![WorkerState::fresh(); workers],
            batches: 0,
            epoch_samples: Some(0),
            epoch_ends: 0,
        }
    }

    /// The positions of a job of `world` ranks × `workers` loader workers, continuing the
    /// positions `saved` of a job of another shape with the same total of workers. A worker's
    /// shards, shuffle and augmentation depend only on its global index
    /// (`Placement::global_worker`), so worker `g` of the new job takes up exactly where worker
    /// `g` of the old one stopped: every sample of the epoch is still read once, only the grouping
    /// of samples into ranks' batches changes (and, with token-budget batches, whose length draw
    /// follows the worker's index within its rank, the lengths drawn). Each rank starts its round-robin at its first worker; the epoch's sample count
    /// (kept for the error of an empty epoch) becomes unknown where some workers had already
    /// finished it.
    pub fn regroup(saved: &[LoaderPosition], world: usize, workers: usize) -> Result<Vec<LoaderPosition>> {
        let old_world = saved.len();
        let old_workers = saved.first().map_or(0, |p| p.workers.len());
        if old_world == 0 || saved.iter().any(|p| p.workers.len() != old_workers || p.exhausted.len() != old_workers) {
            bail!("the saved loader positions do not all have {old_workers} workers: the checkpoint's state.json is damaged");
        }
        let total = old_world * old_workers;
        if world * workers != total {
            let hint = if total.is_multiple_of(world) {
                format!("set data.workers = {} so that each of the {total} streams continues where it stopped", total / world)
            } else {
                format!("{world} ranks cannot split them evenly; resume on a number of ranks that divides {total}")
            };
            bail!(
                "the checkpoint's data came from {old_world} ranks × {old_workers} loader workers = {total} streams, and this run has {world} × {workers}: {hint}"
            );
        }
        // Ranks may stand in different epochs (their shares of an epoch differ by a shard). The
        // new ranks take the latest: a worker from a rank still in an earlier epoch is not
        // exhausted, and its ends of epochs before this one are ignored as already counted, so it
        // reads on, alone if need be, until it too ends this epoch.
        let epoch = saved.iter().map(|p| p.epoch).max().unwrap_or(0);
        Ok((0..world)
            .map(|rank| {
                let sources: Vec<(usize, usize)> = (0..workers)
                    .map(|w| (rank + world * w) % old_world)
                    .zip((0..workers).map(|w| (rank + world * w) / old_world))
                    .collect();
                let states: Vec<WorkerState> = sources.iter().map(|&(r, w)| saved[r].workers[w].clone()).collect();
                let exhausted: Vec<bool> = sources.iter().map(|&(r, w)| saved[r].exhausted[w] && saved[r].epoch == epoch).collect();
                let ends = exhausted.iter().filter(|&&e| e).count();
                LoaderPosition {
                    epoch,
                    next_worker: 0,
                    batches: states.iter().map(|s| s.batches).sum(),
                    epoch_samples: if ends == 0 { Some(0) } else { None },
                    epoch_ends: ends,
                    exhausted,
                    workers: states,
                }
            })
            .collect())
    }

    pub fn skips(&self) -> SkipCounts {
        let mut s = SkipCounts::default();
        for w in &self.workers {
            s.merge(&w.skips);
        }
        s
    }

    pub fn samples(&self) -> u64 {
        self.workers.iter().map(|w| w.samples).sum()
    }

    /// Samples emitted by source, over the workers.
    pub fn source_samples(&self) -> Vec<u64> {
        let mut total: Vec<u64> = Vec::new();
        for w in &self.workers {
            if total.len() < w.source_samples.len() {
                total.resize(w.source_samples.len(), 0);
            }
            for (t, n) in total.iter_mut().zip(&w.source_samples) {
                *t += n;
            }
        }
        total
    }
}

#[derive(Debug, Clone)]
pub struct LoaderSettings {
    pub image: ImageConfig,
    pub batch_size: usize,
    pub shuffle_buffer: usize,
    pub seed: u64,
    /// Batches each worker may have ready ahead of the trainer.
    pub prefetch: usize,
    /// Scheduling priority the workers give up (`util::threads::lower_priority`).
    pub nice: i32,
    /// NaFlex token-budget batches: each batch's sequence length drawn, its size scaled to it
    /// (`batch_size` is then the batch at the longest length).
    pub token_budget: Option<TokenBudget>,
    /// A distillation teacher's rows for every sample.
    pub teacher: Option<Arc<TeacherFeed>>,
}

enum Msg {
    Batch(Box<Batch>, Box<WorkerState>),
    /// A worker finished its epoch; its skips so far (a worker whose every sample was bad has no
    /// batch to report them with).
    EpochEnd {
        epoch: u64,
        samples_in_epoch: Option<u64>,
        skips: SkipCounts,
    },
}

/// How long a stop signal lets the loader go on waiting for a batch before giving up on it.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// A stop signal arrived while the loader waited for its workers: the step that wanted the
/// batch cannot finish, and the run stops at its last checkpoint.
#[derive(Debug)]
pub struct LoaderStopped;

impl std::fmt::Display for LoaderStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped while waiting for data")
    }
}

impl std::error::Error for LoaderStopped {}

pub struct TrainLoader {
    receivers: Vec<Receiver<Msg>>,
    handles: Vec<JoinHandle<()>>,
    pos: LoaderPosition,
    /// Each worker's skips at its last epoch end, for the error of an epoch without a sample.
    epoch_end_skips: Vec<SkipCounts>,
}

const AUGMENT: u64 = 0x4155_474d_454e_5431;
const BUFFER: u64 = 0x4255_4646_4552_5f31;

impl TrainLoader {
    /// Starts the workers. `placement` gives rank, world size and worker count (its `worker` field
    /// is ignored). `resume` restores a saved position (same worker count required).
    pub fn start(
        plan: ShardPlan,
        placement: Placement,
        settings: LoaderSettings,
        tokenizer: Arc<TextTokenizer>,
        resume: Option<LoaderPosition>,
    ) -> Result<Self> {
        if plan.shards.is_empty() {
            bail!("no training shards");
        }
        if placement.workers == 0 || settings.batch_size == 0 {
            bail!("workers and batch size must be positive");
        }
        if settings.token_budget.is_some() && settings.image.naflex.is_none() {
            bail!("token-budget batches hold NaFlex images, and this model's image tower takes fixed-size images (data.image.naflex is not set)");
        }
        if !plan.resampled && plan.min_shards_per_rank(placement.world_size) == 0 {
            bail!(
                "{} shards cannot be split over {} ranks: every rank needs at least one (use resampled mode or more shards)",
                plan.shards.len(),
                placement.world_size
            );
        }
        let pos = resume.unwrap_or_else(|| LoaderPosition::fresh(placement.workers));
        if pos.workers.len() != placement.workers {
            bail!(
                "the saved loader position has {} workers but {} are configured: resume with the same `data.workers`",
                pos.workers.len(),
                placement.workers
            );
        }
        check_position(&pos, &plan, placement)?;
        let per_rank = plan.shards.len().div_ceil(placement.world_size);
        if !plan.resampled && per_rank < placement.workers {
            log::warn(format!("{} workers but at most {per_rank} shards per rank: some workers will idle", placement.workers));
        }
        let plan = Arc::new(plan);
        let settings = Arc::new(settings);
        let mut receivers = Vec::new();
        let mut handles = Vec::new();
        for w in 0..placement.workers {
            let worker = Worker {
                plan: plan.clone(),
                at: placement.with_worker(w),
                settings: settings.clone(),
                tokenizer: tokenizer.clone(),
                state: pos.workers[w].clone(),
                buffer: ShuffleBuffer::new(settings.shuffle_buffer),
                batch: BatchBuilder::new(settings.batch_size, super::batch::ImageLayout::of(&settings.image), tokenizer.max_len()),
                batch_image: settings.image.clone(),
                teacher: settings.teacher.clone().map(TeacherSide::new),
                cache: None,
            };
            let (rx, handle) = super::reader_thread::spawn(&format!("loader-{w}"), settings.prefetch, move |tx| worker.run(tx))?;
            receivers.push(rx);
            handles.push(handle);
        }
        let epoch_end_skips = vec![SkipCounts::default(); placement.workers];
        Ok(TrainLoader { receivers, handles, pos, epoch_end_skips })
    }

    /// The next batch, in an order fixed by the seed and worker count.
    pub fn next_batch(&mut self) -> Result<Batch> {
        let n = self.receivers.len();
        loop {
            if self.pos.exhausted.iter().all(|&e| e) {
                // Any epoch, not only the first: shards that vanish mid-run would otherwise make
                // the workers race through empty epochs forever. The counts are part of the saved
                // position, so an epoch resumed at any step (its last batch included) is judged
                // on all of its samples.
                if self.pos.epoch_samples == Some(0) && self.pos.epoch_ends == n {
                    bail!(
                        "epoch {} produced no usable sample: every shard is unreadable or empty (skipped: {})",
                        self.pos.epoch,
                        self.epoch_end_skips
                            .iter()
                            .fold(SkipCounts::default(), |mut all, s| {
                                all.merge(s);
                                all
                            })
                            .summary()
                    );
                }
                self.pos.epoch += 1;
                self.pos.exhausted.iter_mut().for_each(|e| *e = false);
                self.pos.epoch_samples = Some(0);
                self.pos.epoch_ends = 0;
            }
            let w = self.pos.next_worker;
            if self.pos.exhausted[w] {
                self.pos.next_worker = (w + 1) % n;
                continue;
            }
            let msg = self.receive(w)?;
            match msg {
                Msg::Batch(batch, state) => {
                    self.pos.workers[w] = *state;
                    self.pos.next_worker = (w + 1) % n;
                    self.pos.batches += 1;
                    return Ok(*batch);
                }
                // An epoch end the restored position already accounts for.
                Msg::EpochEnd { epoch, .. } if epoch < self.pos.epoch => {}
                Msg::EpochEnd { samples_in_epoch, skips, .. } => {
                    self.epoch_end_skips[w] = skips;
                    self.pos.epoch_samples = self.pos.epoch_samples.zip(samples_in_epoch).map(|(a, b)| a + b);
                    self.pos.epoch_ends += 1;
                    self.pos.exhausted[w] = true;
                    self.pos.next_worker = (w + 1) % n;
                }
            }
        }
    }

    /// Worker `w`'s next message. After a stop signal the wait goes on a few seconds more (the
    /// step in progress finishes and is saved, as any stop does), then ends with
    /// [`LoaderStopped`]: a shard source that sends nothing cannot hold the run.
    fn receive(&self, w: usize) -> Result<Msg> {
        let mut stop_seen: Option<std::time::Instant> = None;
        loop {
            match self.receivers[w].recv_timeout(std::time::Duration::from_millis(200)) {
                Ok(msg) => return Ok(msg),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => bail!("loader worker {w} stopped unexpectedly"),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if crate::util::interrupt::requested() {
                        let since = *stop_seen.get_or_insert_with(std::time::Instant::now);
                        if since.elapsed() >= STOP_GRACE {
                            return Err(LoaderStopped.into());
                        }
                    }
                }
            }
        }
    }

    pub fn position(&self) -> &LoaderPosition {
        &self.pos
    }

    pub fn skips(&self) -> SkipCounts {
        self.pos.skips()
    }
}

/// A saved position must be one this loader could have reached: a damaged or hand-edited state
/// (a cursor of 10^9, an epoch of 2^60) is refused, naming the field, instead of skipping data
/// or spinning through empty epochs.
fn check_position(pos: &LoaderPosition, plan: &ShardPlan, placement: Placement) -> Result<()> {
    // Every finished epoch produced at least one sample (an empty one is an error).
    if pos.epoch > pos.samples() {
        bail!(
            "the saved loader position is at epoch {} after only {} samples: the checkpoint's state.json is damaged",
            pos.epoch,
            pos.samples()
        );
    }
    if pos.exhausted.len() != pos.workers.len() || pos.next_worker >= pos.workers.len().max(1) {
        bail!(
            "the saved loader position's worker bookkeeping does not match its {} workers: the checkpoint's state.json is damaged",
            pos.workers.len()
        );
    }
    for (w, state) in pos.workers.iter().enumerate() {
        let bad = |what: String| anyhow::anyhow!("the saved loader position of worker {w}: {what}: the checkpoint's state.json is damaged");
        if state.epoch > pos.epoch + 1 {
            return Err(bad(format!("epoch {} is past the loader's epoch {}", state.epoch, pos.epoch)));
        }
        let read = state.samples + state.skips.total() + state.buffer.len() as u64;
        if state.next_index > read {
            return Err(bad(format!("sample index {} in its shard, after reading {read} samples in all", state.next_index)));
        }
        if !plan.resampled {
            let shards = plan.worker_shards(state.epoch, placement.with_worker(w)).len();
            if state.cursor > shards {
                return Err(bad(format!("shard position {} of the {shards} it reads in an epoch", state.cursor)));
            }
        }
        if let Some((c, i)) = state.buffer.iter().find(|(c, i)| *c > state.cursor || (*c == state.cursor && *i >= state.next_index)) {
            return Err(bad(format!("buffered sample {i} of shard position {c} lies past its reading position")));
        }
    }
    Ok(())
}

impl Drop for TrainLoader {
    fn drop(&mut self) {
        // Closing the queues makes each worker's next send fail, which ends it.
        self.receivers.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

struct Worker {
    plan: Arc<ShardPlan>,
    at: Placement,
    settings: Arc<LoaderSettings>,
    tokenizer: Arc<TextTokenizer>,
    state: WorkerState,
    buffer: ShuffleBuffer<RawSample>,
    batch: BatchBuilder,
    /// The image settings of the batch being formed (a token-budget batch's patch budget).
    batch_image: ImageConfig,
    teacher: Option<TeacherSide>,
    cache: Option<(u64, Vec<usize>)>,
}

/// The worker's queue is gone: the loader was dropped.
struct Closed;

/// A worker's queue, and its mark as at work, which it gives up while it waits for room.
struct Queue<'a> {
    tx: &'a SyncSender<Msg>,
    at_work: &'a LoaderAtWork,
}

impl Queue<'_> {
    fn send(&self, msg: Msg) -> Result<(), Closed> {
        self.at_work.waiting(|| self.tx.send(msg)).map_err(|_| Closed)
    }
}

impl Worker {
    fn run(mut self, tx: SyncSender<Msg>) {
        crate::util::threads::lower_priority(self.settings.nice);
        let at_work = LoaderAtWork::enter();
        if let Err(Closed) = self.run_inner(&Queue { tx: &tx, at_work: &at_work }) {
            // Normal shutdown.
        }
    }

    fn run_inner(&mut self, tx: &Queue) -> Result<(), Closed> {
        self.restore_buffer();
        loop {
            while let Some(shard) = self.plan.shard_at(self.state.epoch, self.at, self.state.cursor, &mut self.cache) {
                self.read_one_shard(shard, tx)?;
                self.state.cursor += 1;
                self.state.next_index = 0;
            }
            while !self.buffer.is_empty() {
                self.pop_and_process(tx)?;
            }
            let epoch = self.state.epoch;
            let skips = self.state.skips.clone();
            let end = Msg::EpochEnd { epoch, samples_in_epoch: self.state.epoch_samples, skips };
            tx.send(end)?;
            self.state.epoch += 1;
            self.state.cursor = 0;
            self.state.next_index = 0;
            self.state.pops = 0;
            self.state.epoch_samples = Some(0);
        }
    }

    fn read_one_shard(&mut self, shard: usize, tx: &Queue) -> Result<(), Closed> {
        let source = self.plan.shards[shard].clone();
        let start = self.state.next_index;
        let cursor = self.state.cursor;
        let mut result = Ok(());
        read_shard(&source, |ev| {
            match ev {
                ShardEvent::Sample(s) => {
                    if s.index < start {
                        return true;
                    }
                    self.state.next_index = s.index + 1;
                    self.buffer.push(cursor, s.index, s);
                    if self.buffer.is_over() {
                        if let Err(c) = self.pop_and_process(tx) {
                            result = Err(c);
                            return false;
                        }
                    }
                }
                ShardEvent::BadSample { key, index, reason, detail } => {
                    if index >= start {
                        self.state.next_index = index + 1;
                        self.state.skips.add(reason);
                        log::warn_sample(&source.to_string(), reason, format!("shard {source}: sample {key}: {detail}; skipped"));
                    }
                }
                ShardEvent::Failed { reason, detail } => {
                    self.state.skips.add(reason);
                    log::warn(format!("shard {source}: {detail}; rest of the shard skipped"));
                }
            }
            true
        });
        result
    }

    fn pop_and_process(&mut self, tx: &Queue) -> Result<(), Closed> {
        let mut rng = Rng::derived(self.settings.seed, &[BUFFER, self.at.global_worker(), self.state.epoch, self.state.pops]);
        self.state.pops += 1;
        match self.buffer.draw(&mut rng) {
            Some((cursor, index, sample)) => self.process(cursor, index, sample, tx),
            None => Ok(()),
        }
    }

    fn process(&mut self, cursor: usize, index: u64, s: RawSample, tx: &Queue) -> Result<(), Closed> {
        let mut rng = Rng::derived(self.settings.seed, &[AUGMENT, self.at.global_worker(), self.state.epoch, cursor as u64, index]);
        if self.batch.is_empty() {
            self.begin_batch();
        }
        let cfg = &self.batch_image;
        let shard = self.plan.shard_at(self.state.epoch, self.at, cursor, &mut self.cache).unwrap_or(0);
        let outcome = (|| -> Result<(), sample::Rejected> {
            let caps = sample::captions(&s)?;
            let label = sample::label(&s)?;
            let bytes = sample::image_bytes(&s)?;
            let img = decode(bytes, decode_min_side(cfg, true), cfg.max_pixels, cfg.alpha)
                .map_err(|e| sample::Rejected { reason: e.reason, detail: e.detail })?;
            let caption = caps[rng.below(caps.len())].clone();
            let teacher = match self.teacher.as_mut() {
                Some(t) => {
                    let at = StreamAt { epoch: self.state.epoch, cursor, oldest_live: self.buffer.oldest_cursor().unwrap_or(cursor) };
                    Some(t.prepare(at, &self.plan.shards[shard].to_string(), &s.key, &caption, bytes)?)
                }
                None => None,
            };
            self.batch.add(&s.key, caption, label, &self.tokenizer, |row| train_transform(&img, cfg, &mut rng, row))?;
            if let (Some(side), Some(rows)) = (self.teacher.as_mut(), teacher) {
                side.push(rows);
            }
            Ok(())
        })();
        if let Err(rej) = outcome {
            self.state.skips.add(rej.reason);
            let shard = self.plan.shards[shard].clone();
            log::warn_sample(&shard.to_string(), rej.reason, format!("shard {shard}: sample {}: {}; skipped", s.key, rej.detail));
            return Ok(());
        }
        self.state.samples += 1;
        if let Some(n) = self.state.epoch_samples.as_mut() {
            *n += 1;
        }
        let source = self.plan.source_of(shard);
        if self.state.source_samples.len() <= source {
            self.state.source_samples.resize(source + 1, 0);
        }
        self.state.source_samples[source] += 1;
        if self.batch.is_full() {
            self.state.batches += 1;
            let mut snapshot = self.state.clone();
            snapshot.buffer = self.buffer.positions();
            let mut batch = self.batch.take();
            batch.teacher = self.teacher.as_mut().and_then(TeacherSide::take);
            tx.send(Msg::Batch(Box::new(batch), Box::new(snapshot)))?;
        }
        Ok(())
    }

    /// Draws a token-budget batch's length and sizes the batch for it; nothing without a budget.
    /// Drawn again, identically, when the batch's first sample is rejected.
    fn begin_batch(&mut self) {
        let Some(budget) = &self.settings.token_budget else { return };
        let seq_len = budget.draw(self.settings.seed, self.at.worker, self.state.batches);
        let mut image = self.settings.image.clone();
        if let Some(n) = image.naflex.as_mut() {
            n.max_num_patches = seq_len;
        }
        self.batch.reshape(budget.batch_size(seq_len), super::batch::ImageLayout::of(&image));
        self.batch_image = image;
    }

    /// Refills the shuffle buffer of a restored state by re-reading the shards its samples came
    /// from. Nothing is decoded and nothing is counted twice.
    fn restore_buffer(&mut self) {
        let wanted: Vec<(usize, u64)> = std::mem::take(&mut self.state.buffer);
        if wanted.is_empty() {
            return;
        }
        let want_set: HashSet<(usize, u64)> = wanted.iter().copied().collect();
        let mut found: HashMap<(usize, u64), RawSample> = HashMap::new();
        let first = wanted.iter().map(|w| w.0).min().unwrap_or(0);
        for cursor in first..=self.state.cursor {
            let Some(shard) = self.plan.shard_at(self.state.epoch, self.at, cursor, &mut self.cache) else {
                break;
            };
            let limit = if cursor == self.state.cursor { self.state.next_index } else { u64::MAX };
            if limit == 0 {
                continue;
            }
            read_shard(&self.plan.shards[shard], |ev| {
                if let ShardEvent::Sample(s) = ev {
                    if s.index >= limit {
                        return false;
                    }
                    if want_set.contains(&(cursor, s.index)) {
                        found.insert((cursor, s.index), s);
                    }
                }
                true
            });
        }
        for (c, i) in wanted {
            match found.remove(&(c, i)) {
                Some(s) => self.buffer.push(c, i, s),
                None => log::warn(format!("resuming: buffered sample {i} of shard position {c} could not be re-read; it is lost")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard_writer::ShardWriter;
    use crate::data::spec::ShardSource;
    use crate::data::tokenizer::train_wordpiece;
    use crate::data::transform::ImageConfig;
    use std::path::Path;

    fn png(v: u8) -> Vec<u8> {
        let img = image::RgbImage::from_pixel(12, 10, image::Rgb([v, v, v]));
        let mut out = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png).unwrap();
        out
    }

    /// `shards` shards of `per` samples; sample (s, i) has caption "s{s} i{i}" and pixel value
    /// 7*s + i so batches can be traced back to samples.
    fn make_shards(dir: &Path, shards: usize, per: usize) -> Vec<ShardSource> {
        (0..shards)
            .map(|s| {
                let path = dir.join(format!("shard-{s}.tar"));
                let mut w = ShardWriter::create(&path).unwrap();
                for i in 0..per {
                    w.write_sample(
                        &format!("s{s}-{i:03}"),
                        &[("png", png((7 * s + i) as u8)), ("txt", format!("shard {s} item {i}").into_bytes())],
                    )
                    .unwrap();
                }
                w.finish().unwrap();
                ShardSource::File(path)
            })
            .collect()
    }

    /// Epoch mode over `shards`, one source.
    fn plan_of(shards: Vec<ShardSource>, seed: u64, shuffle: bool) -> ShardPlan {
        ShardPlan { shards, seed, shuffle, resampled: false, weights: Vec::new(), sources: Vec::new() }
    }

    fn tokenizer() -> Arc<TextTokenizer> {
        let caps: Vec<String> = (0..10).map(|i| format!("shard {i} item {i}")).collect();
        Arc::new(TextTokenizer::new(train_wordpiece(caps.iter(), 100, true, 1).unwrap(), 8).unwrap())
    }

    fn settings(batch: usize, buffer: usize) -> LoaderSettings {
        LoaderSettings {
            image: ImageConfig { image_size: 8, resize: 10, ..Default::default() },
            batch_size: batch,
            shuffle_buffer: buffer,
            seed: 11,
            prefetch: 2,
            nice: 0,
            token_budget: None,
            teacher: None,
        }
    }

    fn keys(loader: &mut TrainLoader, batches: usize) -> Vec<Vec<String>> {
        (0..batches).map(|_| loader.next_batch().unwrap().keys).collect()
    }

    #[test]
    fn one_epoch_covers_every_sample_once_and_the_order_is_reproducible() {
        let dir = tempfile::tempdir().unwrap();
        // Three workers with two shards of five each: six batches of five are exactly one epoch.
        let shards = make_shards(dir.path(), 6, 5);
        let plan = ShardPlan { shards, seed: 3, shuffle: true, resampled: false, weights: Vec::new(), sources: Vec::new() };
        let mut a = TrainLoader::start(plan.clone(), Placement::single(3), settings(5, 4), tokenizer(), None).unwrap();
        let ka = keys(&mut a, 6);
        let mut all: Vec<String> = ka.iter().flatten().cloned().collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 30, "{ka:?}");
        let mut b = TrainLoader::start(plan, Placement::single(3), settings(5, 4), tokenizer(), None).unwrap();
        assert_eq!(ka, keys(&mut b, 6));
    }

    #[test]
    fn the_shuffle_buffer_mixes_samples_within_a_worker() {
        let dir = tempfile::tempdir().unwrap();
        let shards = make_shards(dir.path(), 1, 30);
        let plan = ShardPlan { shards, seed: 3, shuffle: false, resampled: false, weights: Vec::new(), sources: Vec::new() };
        let mut l = TrainLoader::start(plan.clone(), Placement::single(1), settings(30, 0), tokenizer(), None).unwrap();
        let sequential = l.next_batch().unwrap().keys;
        let want: Vec<String> = (0..30).map(|i| format!("s0-{i:03}")).collect();
        assert_eq!(sequential, want);
        let mut l = TrainLoader::start(plan, Placement::single(1), settings(30, 10), tokenizer(), None).unwrap();
        let shuffled = l.next_batch().unwrap().keys;
        assert_ne!(shuffled, want);
        let mut sorted = shuffled.clone();
        sorted.sort();
        assert_eq!(sorted, want);
    }

    /// NaFlex images of 2-pixel patches in token-budget batches: 4 images at 16 patches, 7 at 9,
    /// 16 at 4.
    fn budget_settings() -> LoaderSettings {
        let naflex = crate::data::transform::Naflex { patch_size: 2, max_num_patches: 16 };
        LoaderSettings {
            image: ImageConfig { image_size: 2, resize: 2, naflex: Some(naflex), ..Default::default() },
            token_budget: Some(TokenBudget::new(&[4, 9, 16], 1, 4)),
            ..settings(4, 6)
        }
    }

    /// Every step is a possible checkpoint: a loader restored from the position after any batch
    /// (epoch ends included) continues with exactly the batches of the uninterrupted one, for one
    /// and two ranks, one and two workers, in epoch, resampled and weighted resampled modes, and
    /// with token-budget batches.
    #[test]
    fn a_position_saved_after_any_batch_continues_with_exactly_the_same_batches() {
        let dir = tempfile::tempdir().unwrap();
        // 35 samples dealt to up to four workers at 4 a batch: 25 batches span five or more epochs
        // on every rank, and partial batches carry samples across epoch ends.
        let shards = make_shards(dir.path(), 5, 7);
        let batches = 25;
        let budget = budget_settings();
        for (resampled, weights, settings) in [
            (false, vec![], settings(4, 6)),
            (true, vec![], settings(4, 6)),
            (true, vec![3.0, 1.0, 1.0, 0.5, 0.5], settings(4, 6)),
            (false, vec![], budget.clone()),
            (true, vec![], budget),
        ] {
            let budget = settings.token_budget.is_some();
            for world_size in [1, 2] {
                for workers in [1, 2] {
                    let plan = ShardPlan {
                        shards: shards.clone(),
                        seed: 5,
                        shuffle: true,
                        resampled,
                        weights: weights.clone(),
                        sources: Vec::new(),
                    };
                    for rank in 0..world_size {
                        let at = Placement { rank, world_size, worker: 0, workers };
                        let start = |from: Option<LoaderPosition>| {
                            TrainLoader::start(plan.clone(), at, settings.clone(), tokenizer(), from).unwrap()
                        };
                        let mut full = start(None);
                        let mut reference = Vec::new();
                        let mut positions = Vec::new();
                        for _ in 0..batches {
                            reference.push(full.next_batch().unwrap());
                            positions.push(serde_json::to_string(full.position()).unwrap());
                        }
                        assert!(resampled || full.position().epoch >= 2, "the reference run must cross two epoch ends");
                        if budget {
                            let sizes: HashSet<usize> = reference.iter().map(|b| b.size).collect();
                            assert_eq!(sizes, HashSet::from([4, 7, 16]), "every length is drawn");
                            for b in &reference {
                                // Each image a row of its batch's length: 12 numbers a patch, then the grid.
                                let patches = (b.image.numel - 2) / 12;
                                assert_eq!(
                                    (b.size, b.images.len()),
                                    ([(4, 16), (9, 7), (16, 4)].iter().find(|p| p.0 == patches).unwrap().1, b.size * b.image.numel)
                                );
                            }
                        }
                        for stop in 1..batches {
                            let saved: LoaderPosition = serde_json::from_str(&positions[stop - 1]).unwrap();
                            let mut resumed = start(Some(saved));
                            for (k, want) in reference.iter().enumerate().skip(stop) {
                                let got = resumed.next_batch().unwrap_or_else(|e| {
                                    panic!(
                                        "resampled={resampled} ranks={world_size} rank={rank} workers={workers} stop={stop} batch={k}: {e}"
                                    )
                                });
                                let at = format!(
                                    "resampled={resampled} budget={budget} ranks={world_size} rank={rank} workers={workers} stop={stop} batch={k}"
                                );
                                assert_eq!(got.keys, want.keys, "{at}");
                                assert!(got.images == want.images && got.ids == want.ids, "{at}");
                                assert_eq!(serde_json::to_string(resumed.position()).unwrap(), positions[k], "{at}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Takes `n` batches from `loader` (rank `rank` of `world`), appending each batch's keys to
    /// the stream of the global worker that formed it.
    fn by_stream(loader: &mut TrainLoader, rank: usize, world: usize, n: usize, streams: &mut HashMap<usize, Vec<String>>) {
        let workers = loader.position().workers.len();
        for _ in 0..n {
            let keys = loader.next_batch().unwrap().keys;
            let w = (loader.position().next_worker + workers - 1) % workers;
            streams.entry(rank + world * w).or_default().extend(keys);
        }
    }

    /// A job saved on 2 ranks × 2 workers and resumed on 4 × 1, then on 1 × 4 (the same four
    /// streams), after any of its first steps: every stream goes on with exactly the samples it
    /// would have read uninterrupted, across epoch ends; other shapes are refused.
    #[test]
    fn positions_regroup_onto_another_number_of_ranks_with_the_same_streams() {
        let dir = tempfile::tempdir().unwrap();
        // Four streams of two 5-sample shards an epoch: 10 samples a stream per epoch.
        let plan = plan_of(make_shards(dir.path(), 8, 5), 9, true);
        let job = |world: usize, workers: usize, batch: usize, from: Option<Vec<LoaderPosition>>| -> Vec<TrainLoader> {
            (0..world)
                .map(|rank| {
                    let at = Placement { rank, world_size: world, worker: 0, workers };
                    let pos = from.as_ref().map(|p| p[rank].clone());
                    TrainLoader::start(plan.clone(), at, settings(batch, 3), tokenizer(), pos).unwrap()
                })
                .collect()
        };
        let mut reference = HashMap::new();
        for (rank, l) in job(2, 2, 4, None).iter_mut().enumerate() {
            by_stream(l, rank, 2, 30, &mut reference);
        }
        let mut ranks_apart = false;
        for saved_after in 1..=8 {
            let mut streams = HashMap::new();
            let mut old = job(2, 2, 4, None);
            for (rank, l) in old.iter_mut().enumerate() {
                by_stream(l, rank, 2, saved_after, &mut streams);
            }
            let saved: Vec<LoaderPosition> = old.iter().map(|l| l.position().clone()).collect();
            let four = LoaderPosition::regroup(&saved, 4, 1).unwrap();
            let mut wide = job(4, 1, 2, Some(four));
            for (rank, l) in wide.iter_mut().enumerate() {
                by_stream(l, rank, 4, 10, &mut streams);
            }
            let saved: Vec<LoaderPosition> = wide.iter().map(|l| l.position().clone()).collect();
            ranks_apart |= saved.iter().any(|p| p.epoch != saved[0].epoch);
            let one = LoaderPosition::regroup(&saved, 1, 4).unwrap();
            assert!(one[0].epoch >= 1, "the test must cross an epoch end");
            by_stream(&mut job(1, 4, 8, Some(one))[0], 0, 1, 5, &mut streams);
            assert_eq!(streams.len(), 4);
            for (g, keys) in &streams {
                let want = &reference[g];
                assert!(keys.len() <= want.len(), "stream {g}: the reference is too short");
                assert_eq!(keys[..], want[..keys.len()], "stream {g}, saved after {saved_after} steps");
            }
            let err = LoaderPosition::regroup(&saved, 3, 1).unwrap_err().to_string();
            assert!(err.contains("4 streams") && err.contains("divides 4"), "{err}");
            let err = LoaderPosition::regroup(&saved, 2, 1).unwrap_err().to_string();
            assert!(err.contains("data.workers = 2"), "{err}");
        }
        assert!(ranks_apart, "some save must find the ranks in different epochs");
    }

    /// A position written before the epoch's counts were saved still loads and resumes; its
    /// epoch simply cannot be judged empty.
    #[test]
    fn a_position_without_epoch_counts_still_resumes() {
        let dir = tempfile::tempdir().unwrap();
        let shards = make_shards(dir.path(), 2, 4);
        let plan = ShardPlan { shards, seed: 1, shuffle: false, resampled: false, weights: Vec::new(), sources: Vec::new() };
        let mut l = TrainLoader::start(plan.clone(), Placement::single(1), settings(4, 0), tokenizer(), None).unwrap();
        l.next_batch().unwrap();
        l.next_batch().unwrap();
        let want = l.next_batch().unwrap().keys;
        let mut l = TrainLoader::start(plan.clone(), Placement::single(1), settings(4, 0), tokenizer(), None).unwrap();
        l.next_batch().unwrap();
        l.next_batch().unwrap();
        let mut old = serde_json::to_value(l.position()).unwrap();
        old.as_object_mut().unwrap().remove("epoch_samples");
        old.as_object_mut().unwrap().remove("epoch_ends");
        old["workers"][0].as_object_mut().unwrap().remove("epoch_samples");
        let old: LoaderPosition = serde_json::from_value(old).unwrap();
        let mut resumed = TrainLoader::start(plan, Placement::single(1), settings(4, 0), tokenizer(), Some(old)).unwrap();
        assert_eq!(resumed.next_batch().unwrap().keys, want);
    }

    #[test]
    fn bad_samples_and_truncated_shards_are_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.tar");
        let mut w = ShardWriter::create(&path).unwrap();
        w.write_sample("good1", &[("png", png(1)), ("txt", b"ok".to_vec())]).unwrap();
        w.write_sample("corrupt", &[("png", b"not a png".to_vec()), ("txt", b"ok".to_vec())]).unwrap();
        w.write_sample("nocap", &[("png", png(2))]).unwrap();
        w.write_sample("empty", &[("png", png(2)), ("txt", b" ".to_vec())]).unwrap();
        w.write_sample("good2", &[("png", png(3)), ("txt", b"ok".to_vec())]).unwrap();
        w.write_sample("cut", &[("png", png(4)), ("txt", vec![b'x'; 5000])]).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // Cut inside the 5000-byte caption of the last sample.
        let at = bytes.windows(4).position(|w| w == b"xxxx").unwrap() + 100;
        std::fs::write(&path, &bytes[..at]).unwrap();
        let plan = plan_of(vec![ShardSource::File(path)], 1, false);
        let mut l = TrainLoader::start(plan, Placement::single(1), settings(2, 0), tokenizer(), None).unwrap();
        let b = l.next_batch().unwrap();
        assert_eq!(b.keys, vec!["good1", "good2"]);
        // Counts are as of the last batch handed out: the broken tail is not reached yet.
        assert_eq!(l.skips().summary(), "corrupt_image=1, empty_caption=1, missing_caption=1");
        // The second epoch's batch is formed after the first epoch's tail and its own bad samples.
        assert_eq!(l.next_batch().unwrap().keys, vec!["good1", "good2"]);
        let skips = l.skips();
        assert_eq!(skips.get("corrupt_image"), 2);
        assert_eq!(skips.get("missing_caption"), 2);
        assert_eq!(skips.get("empty_caption"), 2);
        assert_eq!(skips.get("incomplete_sample"), 1, "{skips:?}");
        assert_eq!(skips.get("truncated_shard"), 1, "{skips:?}");
    }

    #[test]
    fn a_dataset_with_no_usable_sample_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.tar");
        ShardWriter::create(&path).unwrap().finish().unwrap();
        let plan = plan_of(vec![ShardSource::File(path)], 1, false);
        let mut l = TrainLoader::start(plan, Placement::single(1), settings(2, 0), tokenizer(), None).unwrap();
        let err = l.next_batch().unwrap_err().to_string();
        assert!(err.contains("no usable sample") && err.contains("skipped: none"), "{err}");
        // Every sample bad: the error counts them, though no batch ever carried the counts.
        let path = dir.path().join("bad.tar");
        let mut w = ShardWriter::create(&path).unwrap();
        w.write_sample("corrupt", &[("png", b"not a png".to_vec()), ("txt", b"ok".to_vec())]).unwrap();
        w.write_sample("nocap", &[("png", png(2))]).unwrap();
        w.finish().unwrap();
        let plan = plan_of(vec![ShardSource::File(path)], 1, false);
        let mut l = TrainLoader::start(plan, Placement::single(1), settings(2, 0), tokenizer(), None).unwrap();
        let err = l.next_batch().unwrap_err().to_string();
        assert!(err.contains("corrupt_image=1, missing_caption=1"), "{err}");
    }

    /// Shards that vanish after the first epoch (deleted, a mount gone) make the next epoch an
    /// error, not workers racing through empty epochs forever.
    #[test]
    fn an_empty_epoch_after_good_ones_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let shards = make_shards(dir.path(), 1, 4);
        let plan = ShardPlan { shards, seed: 1, shuffle: false, resampled: false, weights: Vec::new(), sources: Vec::new() };
        let mut l = TrainLoader::start(plan, Placement::single(1), settings(4, 0), tokenizer(), None).unwrap();
        l.next_batch().unwrap();
        std::fs::remove_file(dir.path().join("shard-0.tar")).unwrap();
        let err = (0..6).find_map(|_| l.next_batch().err()).expect("an epoch without samples must fail").to_string();
        assert!(err.contains("produced no usable sample") && err.contains("unreadable_shard"), "{err}");
    }

    #[test]
    fn pixels_and_tokens_land_in_their_batch_rows() {
        let dir = tempfile::tempdir().unwrap();
        let shards = make_shards(dir.path(), 1, 3);
        let plan = ShardPlan { shards, seed: 3, shuffle: false, resampled: false, weights: Vec::new(), sources: Vec::new() };
        let mut s = settings(3, 0);
        s.image.hflip = false;
        let mut l = TrainLoader::start(plan, Placement::single(1), s, tokenizer(), None).unwrap();
        let b = l.next_batch().unwrap();
        let numel = 3 * 8 * 8;
        for (row, v) in [0u8, 1, 2].iter().enumerate() {
            let want = *v as f32 / 127.5 - 1.0;
            assert!(b.images[row * numel..(row + 1) * numel].iter().all(|&x| (x - want).abs() < 1e-6), "row {row}");
        }
        assert_eq!(b.ids.len(), 3 * 8);
        assert_eq!(b.captions[2], "shard 0 item 2");
    }
}
