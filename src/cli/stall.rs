//! `--stall-timeout` for the commands that read shards outside training (training reads
//! `data.stall_timeout_s`): how long a `pipe:` shard may send nothing before it is abandoned.

use anyhow::{ensure, Result};
use clap::Args;

#[derive(Args, Debug, Clone, Copy)]
pub struct StallArg {
    /// Seconds a `pipe:` shard may send nothing before it is abandoned (counted as skipped and
    /// named in a warning) instead of holding the command.
    #[arg(long, default_value_t = 300.0)]
    pub stall_timeout: f64,
}

impl StallArg {
    /// Sets the process's stall timeout, or says why the value cannot be one.
    pub fn apply(self) -> Result<()> {
        ensure!(
            self.stall_timeout > 0.0 && self.stall_timeout.is_finite(),
            "--stall-timeout must be a positive number of seconds, got {}",
            self.stall_timeout
        );
        align::data::pipe_source::set_stall_timeout(std::time::Duration::from_secs_f64(self.stall_timeout));
        Ok(())
    }
}
