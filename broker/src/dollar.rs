//! Placeholder until branch `dollar` lands: `$hw/...` and `$ke/...` travel as `edgemeta$...`.

use std::borrow::Cow;

pub const INTERNAL_PREFIX: &str = "edgemeta$";

pub fn to_broker(client: &str) -> Cow<'_, str> {
    if client.starts_with("$hw/") || client.starts_with("$ke/") {
        Cow::Owned(format!("edgemeta{client}"))
    } else {
        Cow::Borrowed(client)
    }
}

pub fn to_client(broker: &str) -> Cow<'_, str> {
    match broker.strip_prefix("edgemeta") {
        Some(rest) if rest.starts_with("$hw/") || rest.starts_with("$ke/") => Cow::Borrowed(rest),
        _ => Cow::Borrowed(broker),
    }
}
