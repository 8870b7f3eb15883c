//! The rendezvous that starts a multi-process job: rank 0 listens on `MASTER_ADDR:MASTER_PORT`
//! and hands every other rank the same opaque blob (NCCL's unique id); nothing else crosses it.
//! Every wait is bounded by the timeout, and a mismatch (world size, duplicate rank) is an error
//! naming both sides, so a misconfigured job fails at once instead of hanging.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const MAGIC: &[u8; 4] = b"ALGN";
pub const ID_LEN: usize = 128;

fn hello(rank: usize, world: usize) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[..4].copy_from_slice(MAGIC);
    h[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
    h[8..].copy_from_slice(&(world as u32).to_le_bytes());
    h
}

/// Rank 0: serves `id` to the `world - 1` other ranks. Others: fetches it from rank 0.
pub fn share_id(addr: &str, port: u16, rank: usize, world: usize, id: Option<[u8; ID_LEN]>, timeout: Duration) -> Result<[u8; ID_LEN]> {
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        let id = id.context("rank 0 must provide the id to share")?;
        let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("rank 0: listening on port {port} (MASTER_PORT)"))?;
        listener.set_nonblocking(true)?;
        let mut seen = vec![false; world];
        seen[0] = true;
        let mut joined = 1;
        while joined < world {
            match listener.accept() {
                Ok((mut stream, peer)) => {
                    stream.set_nonblocking(false)?;
                    stream.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10))))?;
                    let mut h = [0u8; 12];
                    stream.read_exact(&mut h).with_context(|| format!("rank 0: reading the hello of {peer}"))?;
                    if &h[..4] != MAGIC {
                        bail!("rank 0: {peer} connected to MASTER_PORT {port} but is not an align rank");
                    }
                    let r = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
                    let w = u32::from_le_bytes(h[8..].try_into().unwrap()) as usize;
                    if w != world {
                        bail!("rank {r} (at {peer}) says WORLD_SIZE={w}, rank 0 has WORLD_SIZE={world}");
                    }
                    if r == 0 || r >= world || seen[r] {
                        bail!("rank 0: {peer} claims rank {r}, which is {}", if r >= world { "out of range" } else { "taken" });
                    }
                    seen[r] = true;
                    joined += 1;
                    stream.write_all(&id)?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (0..world).filter(|&r| !seen[r]).collect();
                        bail!(
                            "rendezvous timed out after {:.0} s: ranks {missing:?} never connected to port {port}",
                            timeout.as_secs_f64()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).context("rank 0: accepting a rank"),
            }
        }
        return Ok(id);
    }
    let target = (addr, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving MASTER_ADDR {addr}"))?
        .next()
        .with_context(|| format!("MASTER_ADDR {addr} resolves to nothing"))?;
    loop {
        match TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
            Ok(mut stream) => {
                stream.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10))))?;
                stream.write_all(&hello(rank, world))?;
                let mut id = [0u8; ID_LEN];
                stream
                    .read_exact(&mut id)
                    .with_context(|| format!("rank {rank}: rank 0 at {target} closed the rendezvous (see its error)"))?;
                return Ok(id);
            }
            Err(e) => {
                if Instant::now() >= deadline {
                    bail!("rank {rank}: could not reach rank 0 at {target} within {:.0} s: {e}", timeout.as_secs_f64());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn every_rank_receives_rank_zeros_id() {
        let port = free_port();
        let id: [u8; ID_LEN] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                std::thread::spawn(move || share_id("127.0.0.1", port, rank, 4, (rank == 0).then_some(id), Duration::from_secs(20)))
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn a_missing_rank_times_out_naming_it() {
        let port = free_port();
        let peer = std::thread::spawn(move || share_id("127.0.0.1", port, 1, 3, None, Duration::from_secs(3)));
        let err = share_id("127.0.0.1", port, 0, 3, Some([1; ID_LEN]), Duration::from_millis(1500)).unwrap_err().to_string();
        assert!(err.contains("ranks [2] never connected"), "{err}");
        assert_eq!(peer.join().unwrap().unwrap(), [1; ID_LEN]);
    }

    #[test]
    fn a_world_size_mismatch_is_named() {
        let port = free_port();
        let peer = std::thread::spawn(move || share_id("127.0.0.1", port, 1, 3, None, Duration::from_secs(3)));
        let err = share_id("127.0.0.1", port, 0, 2, Some([1; ID_LEN]), Duration::from_secs(3)).unwrap_err().to_string();
        assert!(err.contains("WORLD_SIZE=3") && err.contains("WORLD_SIZE=2"), "{err}");
        assert!(peer.join().unwrap().is_err());
    }
}
