//! TAP backend placeholder.
