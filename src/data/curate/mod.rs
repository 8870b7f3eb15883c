//! Model-based curation of web pairs for `align data build`: score files written by
//! `align data score` (`scores`: per-sample image-text cosines and embeddings in Parquet), the CLIP
//! score filters (a minimum, and the top fraction of the whole input) that read them, MetaCLIP's
//! balancing over a list of concepts (`metaclip`), and semantic deduplication by embedding
//! (`semdedup`, over `kmeans`).

pub mod kmeans;
pub mod metaclip;
pub mod scores;
pub mod semdedup;
