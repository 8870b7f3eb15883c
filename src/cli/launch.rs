//! `align launch --nproc-per-node N -- <align args>`: starts N local ranks of a multi-process job
//! with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//! MASTER_PORT), and when one fails, stops the others and reports the failing rank. Each line a
//! rank prints comes out prefixed with `[rank N]`, on the stream it was printed to.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args)]
pub struct LaunchArgs {
    /// Processes to start on this node.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Rendezvous address (rank 0's node).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Rendezvous port.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// The align command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

pub fn run(a: &LaunchArgs) -> Result<()> {
    if a.nproc_per_node == 0 || a.nnodes == 0 || a.node_rank >= a.nnodes {
        bail!("need --nproc-per-node >= 1 and --node-rank < --nnodes");
    }
    let exe = std::env::current_exe().context("locating the align executable")?;
    let world = a.nproc_per_node * a.nnodes;
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut forwarders = Vec::new();
    for local in 0..a.nproc_per_node {
        let rank = a.node_rank * a.nproc_per_node + local;
        let child = Command::new(&exe)
            .args(&a.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        let mut child = child;
        let tag = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            forwarders.push(forward_lines(out, tag.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            forwarders.push(forward_lines(err, tag, true));
        }
        children.push((rank, child));
    }
    // Poll so that the first failure stops everyone at once rather than after the slowest rank.
    let mut failure: Option<(usize, std::process::ExitStatus)> = None;
    while !children.is_empty() && failure.is_none() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
                Some(status) => {
                    let (rank, _) = children.remove(i);
                    if !status.success() {
                        failure = Some((rank, status));
                        break;
                    }
                }
                None => i += 1,
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    // Every rank has exited: their last lines are in the pipes.
    for f in forwarders {
        let _ = f.join();
    }
    match failure {
        Some((rank, status)) => bail!("rank {rank} failed ({status}); stopped the other ranks"),
        None => Ok(()),
    }
}

/// Copies a rank's output line by line to ours (stderr or stdout), each line prefixed with `tag`.
fn forward_lines(from: impl Read + Send + 'static, tag: String, to_stderr: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(from).split(b'\n').map_while(Result::ok) {
            let line = format!("{tag}{}\n", String::from_utf8_lossy(&line).trim_end_matches('\r'));
            let _ = if to_stderr { std::io::stderr().write_all(line.as_bytes()) } else { std::io::stdout().write_all(line.as_bytes()) };
        }
    })
}
