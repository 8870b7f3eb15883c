//! This machine's name, for lock files and TensorBoard's event file names.

/// The host name, or `localhost` when the system gives none.
pub fn name() -> String {
    let n = gethostname::gethostname().to_string_lossy().into_owned();
    if n.is_empty() {
        "localhost".into()
    } else {
        n
    }
}
