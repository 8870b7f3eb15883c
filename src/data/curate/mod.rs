//! Model-based curation of web pairs for `align data build`: score files written by
//! `align data score` (`scores`: per-sample image-text cosines and embeddings in Parquet), the CLIP
//! score filters (a minimum, and the top fraction of the whole input) that read them, MetaCLIP's
//! balancing over a list of concepts (`metaclip`), semantic deduplication by embedding
//! (`semdedup`) and DataComp's image-based filter (`image_based`), both over `kmeans`.

pub mod image_based;
pub mod kmeans;
pub mod metaclip;
pub mod scores;
pub mod semdedup;
