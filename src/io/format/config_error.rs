//! What can be wrong with a checkpoint's configuration file, as the readers of every format
//! report it (the caller names the file).

/// A configuration a format's reader refuses.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A value of another type than the key takes.
    #[error("{key}: {message}")]
    Type { key: String, message: String },
    /// An option that changes the architecture in a way align's towers do not follow.
    #[error("{key} is set: {what}, which align does not build")]
    Unsupported { key: String, what: String },
    /// A value out of its bounds, or at odds with another.
    #[error("{0}")]
    Invalid(String),
    /// A model this format cannot express.
    #[error("{0}")]
    Unwritable(String),
}

/// The bounds checks' messages (`io::limits`) name the key and the bound.
impl From<String> for ConfigError {
    fn from(message: String) -> Self {
        ConfigError::Invalid(message)
    }
}
