//! The API's typed errors. Handlers and domain errors say what kind of failure it is
//! ([`ErrorKind`]); the HTTP status is chosen from the kind in one place,
//! [`ErrorKind::status`].

use serde::{Deserialize, Serialize};

/// What went wrong, as far as a client is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or its body invalid, or it cannot be met as asked.
    BadRequest,
    /// The peer's uid is not allowed (`--api-allow-uid`).
    Forbidden,
    /// No such route.
    NotFound,
    /// The route exists, but not with this method.
    MethodNotAllowed,
    /// The request did not arrive in time.
    RequestTimeout,
    /// Not possible in the VM's current state (e.g. already paused, a migration runs).
    Conflict,
    /// A route that takes a body was sent without Content-Length.
    LengthRequired,
    /// The body is over the size limit.
    PayloadTooLarge,
    /// The request line is over the size limit.
    UriTooLong,
    /// The request head is over the size limit.
    HeadersTooLarge,
    /// The VMM failed.
    Internal,
    /// A feature of HTTP the server does not implement (Transfer-Encoding).
    NotImplemented,
    /// The VMM cannot serve this right now (booting, ending, too many requests).
    Unavailable,
    /// The guest did not confirm in time (or refused); nothing changed.
    GuestTimeout,
    /// An HTTP version other than 1.0 and 1.1.
    HttpVersion,
}

impl ErrorKind {
    /// The HTTP status a kind is answered with: the one place statuses are chosen.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::BadRequest => 400,
            ErrorKind::Forbidden => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::Conflict => 409,
            ErrorKind::LengthRequired => 411,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::UriTooLong => 414,
            ErrorKind::HeadersTooLarge => 431,
            ErrorKind::Internal => 500,
            ErrorKind::NotImplemented => 501,
            ErrorKind::Unavailable => 503,
            ErrorKind::GuestTimeout => 504,
            ErrorKind::HttpVersion => 505,
        }
    }
}

/// An error answered to the client as its kind's status with body `{"error": message}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
}

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError { kind, message: message.into() }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::MethodNotAllowed, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, message)
    }
    pub fn payload_too_large(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PayloadTooLarge, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }
    pub fn guest_timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::GuestTimeout, message)
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// The error body, `{"error": message}`.
    pub fn body(&self) -> ErrorBody {
        ErrorBody { error: self.message.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_an_error_status() {
        use ErrorKind::*;
        let kinds = [
            BadRequest,
            Forbidden,
            NotFound,
            MethodNotAllowed,
            RequestTimeout,
            Conflict,
            LengthRequired,
            PayloadTooLarge,
            UriTooLong,
            HeadersTooLarge,
            Internal,
            NotImplemented,
            Unavailable,
            GuestTimeout,
            HttpVersion,
        ];
        let mut seen = std::collections::HashSet::new();
        for k in kinds {
            assert!((400..600).contains(&k.status()), "{k:?}");
            assert!(seen.insert(k.status()), "{k:?}: one status per kind");
        }
        assert_eq!(serde_json::to_value(ApiError::conflict("x").body()).unwrap(), serde_json::json!({"error": "x"}));
    }
}
