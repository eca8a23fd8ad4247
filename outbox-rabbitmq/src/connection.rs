//! Connecting with lapin on the tokio runtime, bounded in time, and the URI shown without its
//! password.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

/// `uri` with the password of `user:password@` replaced by `***`.
pub(crate) fn redact_uri(uri: &str) -> String {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return uri.to_owned();
    };
    match rest.split_once('@') {
        Some((auth, host)) => match auth.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => format!("{scheme}://***@{host}"),
        },
        None => uri.to_owned(),
    }
}

/// Opens a connection named `name` to `uri` within `timeout`.
pub(crate) async fn connect(
    uri: &str,
    name: &str,
    timeout: Duration,
) -> Result<Connection, lapin::Error> {
    let props = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(name.into());
    match tokio::time::timeout(timeout, Connection::connect(uri, props)).await {
        Ok(r) => r,
        Err(_) => Err(
            lapin::ErrorKind::IOError(std::sync::Arc::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no AMQP connection within {timeout:?}"),
            )))
            .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_uri("amqp://relay:s3cret@host:5672/%2f"),
            "amqp://relay:***@host:5672/%2f"
        );
        assert_eq!(redact_uri("amqp://host/%2f"), "amqp://host/%2f");
        assert_eq!(redact_uri("amqp://tok@host"), "amqp://***@host");
    }
}
