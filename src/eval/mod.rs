//! Evaluation: the forward-only embedding path, retrieval, zero-shot classification, KNN and
//! linear probes, the metrics behind them, the records results are written as, suites, the
//! evaluations training runs, and CLIP scores for curation (`score`).

pub mod embed;
pub mod knn;
pub mod linear_probe;
pub mod metrics;
pub mod periodic;
pub mod record;
pub mod retrieval;
pub mod score;
pub mod suite;
pub mod tasks;
pub mod zeroshot;
