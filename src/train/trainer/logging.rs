//! What a run tells as it goes: `metrics.jsonl` (the source of truth), TensorBoard event files
//! derived from the same records, and the progress bar with its running figures, or in a batch
//! job's log (stderr not a terminal) one timestamped line per `train.log_every` steps. Rank 0
//! writes; the other ranks' logs are silent.

use std::time::Instant;

use anyhow::Result;

use super::setup::Run;
use crate::config::Config;
use crate::io::metrics_log::{self, MetricsLog};
use crate::io::tensorboard::EventWriter;
use crate::train::step::StepOutput;
use crate::util::progress::Progress;

pub(super) struct RunLog {
    metrics: Option<MetricsLog>,
    tb: Option<EventWriter>,
    pub bar: Progress,
    /// Since the last logged step: when it began, steps and samples trained, seconds waiting for
    /// data.
    window: (Instant, u64, u64, f64),
    /// Log lines for a batch job, and the schedule's length for their ETA.
    lines: bool,
    total: u64,
}

/// One logged step's figures besides the step's own output.
pub(super) struct StepFigures {
    pub step: u64,
    pub lr: f64,
    pub grad_norm: f64,
    pub temperature: f64,
    /// The sigmoid loss's bias b; with it the loss is SigLIP's, logged as its scale t = 1/σ and b,
    /// without a direction split (each pair is one binary term).
    pub logit_bias: Option<f64>,
    pub samples_seen: u64,
    pub skipped: u64,
    pub elapsed_s: f64,
    /// The distillation teacher's logit scale, when the run distils.
    pub teacher_scale: Option<f64>,
}

impl RunLog {
    /// Opens the logs (rank 0: the metrics log kept through the resumed step, TensorBoard with
    /// the config as text) and writes the run's `config.toml`.
    pub fn open(cfg: &Config, run: &Run, quiet: bool, lead: bool) -> Result<RunLog> {
        let step = run.start.step;
        let metrics = if lead { Some(MetricsLog::open(&run.run_dir.join("metrics.jsonl"), Some(step))?) } else { None };
        let tb = if lead { Some(EventWriter::create(&run.run_dir.join("tb"))?) } else { None };
        if lead {
            let config_toml = cfg.to_toml()?;
            crate::io::tensors::write_atomic(&run.run_dir.join("config.toml"), config_toml.as_bytes())?;
            if let Some(tb) = &tb {
                tb.text(step, "config", &format!("```toml\n{config_toml}\n```"));
            }
        }
        let bar = Progress::with_status(cfg.train.steps, "training", quiet).without_lines();
        bar.set_position(step);
        let lines = !quiet && !crate::util::log::interactive();
        Ok(RunLog { metrics, tb, bar, window: (Instant::now(), 0, 0, 0.0), lines, total: cfg.train.steps })
    }

    /// A record for the metrics log and, its numbers, for TensorBoard.
    pub fn record(&mut self, r: serde_json::Value) -> Result<()> {
        if let Some(m) = self.metrics.as_mut() {
            m.write(&r)?;
        }
        if let (Some(tb), Some(step)) = (&self.tb, r.get("step").and_then(serde_json::Value::as_u64)) {
            let scalars = metrics_log::scalars(&r);
            tb.scalars(step, &scalars.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>());
        }
        Ok(())
    }

    /// Counts a step's samples and its wait for data into the current window.
    pub fn count(&mut self, samples: u64, waited: f64) {
        self.window.1 += 1;
        self.window.2 += samples;
        self.window.3 += waited;
    }

    /// Logs the window that ends with this step (its throughput and data-wait share) and starts
    /// the next.
    pub fn log_step(&mut self, out: &StepOutput, f: &StepFigures) -> Result<()> {
        let secs = self.window.0.elapsed().as_secs_f64().max(1e-9);
        let rate = self.window.2 as f64 / secs;
        let wait_share = self.window.3 / secs;
        let secs_per_step = secs / self.window.1.max(1) as f64;
        self.window = (Instant::now(), 0, 0, 0.0);
        let scale = match f.logit_bias {
            Some(b) => format!("t {:.2} b {b:.2}", 1.0 / f.temperature),
            None => format!("σ {:.4}", f.temperature),
        };
        self.bar.set_message(format!("loss {:.3} {scale} lr {:.2e} {rate:.0} img/s", out.loss, f.lr));
        if self.lines {
            crate::util::log::info(format!(
                "step {}/{} loss {:.4} {scale} lr {:.3e} {rate:.1} samples/s data wait {:.1}% ETA {}",
                f.step,
                self.total,
                out.loss,
                f.lr,
                100.0 * wait_share,
                crate::util::clock::span(self.total.saturating_sub(f.step) as f64 * secs_per_step)
            ));
        }
        let mut r = serde_json::json!({
            "step": f.step, "loss": out.loss, "lr": f.lr, "grad_norm": f.grad_norm, "samples_per_s": rate,
            "samples_seen": f.samples_seen, "data_wait_share": wait_share, "skipped": f.skipped, "elapsed_s": f.elapsed_s,
        });
        match f.logit_bias {
            Some(b) => {
                r["logit_scale"] = (1.0 / f.temperature).into();
                r["logit_bias"] = b.into();
            }
            None => {
                r["loss_i2t"] = out.i2t.into();
                r["loss_t2i"] = out.t2i.into();
                r["temperature"] = f.temperature.into();
            }
        }
        if let Some(d) = out.distill {
            r["distill_loss"] = d.into();
            r["teacher_logit_scale"] = f.teacher_scale.into();
        }
        self.record(r)
    }

    /// Ends the bar and flushes TensorBoard's files.
    pub fn close(self) -> Result<()> {
        self.bar.finish();
        if let Some(tb) = self.tb {
            tb.close()?;
        }
        Ok(())
    }
}
