//! Watches: HTTP 200 and one JSON event per line.
//!
//! Order of work, so that nothing is missed or repeated: subscribe to the committed changes
//! first, then read the history after the version asked for in one snapshot (which reaches the
//! store's version `rev`), then take live changes, skipping those at or below `rev`. Without a
//! version (or "0") the current objects come first as `ADDED`, read the same way.
//!
//! A version the history no longer covers (or one newer than the store: the store was
//! replaced) gets one `ERROR` event with a 410 `Expired` Status and the stream ends: clients
//! relist. A watch that falls behind the live channel reads what it missed from the history,
//! and gets the same 410 only if that is gone too; commits never wait for watchers.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::Response;
use edgemeta_kubewire::{event_line, table};
use edgemeta_metamanager::store::{Change, Event, ListQuery, Since};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use crate::error::error_response;
use crate::kinds::Target;
use crate::object::{selectors, Object, Selectors};
use crate::{Error, Shared};

/// Event lines buffered towards one client before the watch waits for it.
const LINES: usize = 256;

/// How one watch renders what it sends.
struct Render {
    target: Target,
    selectors: Selectors,
    as_table: bool,
    include: table::Include,
}

impl Render {
    /// The event line for a change, if the watch selects it.
    fn change(&self, change: &Change) -> Option<Bytes> {
        if change.res_type != self.target.served.res_type {
            return None;
        }
        if let Some(ns) = &self.target.namespace {
            if change.key.split('/').next() != Some(ns.as_str()) {
                return None;
            }
        }
        self.object(change.event.as_str(), &change.key, &change.value, change.rv)
    }

    fn object(&self, event: &str, key: &str, value: &str, rv: u64) -> Option<Bytes> {
        let kind = self.target.served.kind;
        let object = Object::parse(kind, key, value, rv)?;
        if !self.selectors.matches(&object) {
            return None;
        }
        let line = if self.as_table {
            let table = table::of(
                kind,
                &[object.to_value()],
                &rv.to_string(),
                None,
                self.include,
            );
            event_line(event, &table)
        } else {
            let mut line = format!("{{\"type\":\"{event}\",\"object\":");
            object.write(&mut line);
            line.push_str("}\n");
            line
        };
        Some(Bytes::from(line))
    }

    fn bookmark(&self, rv: u64) -> Bytes {
        let object = edgemeta_kubewire::bookmark(self.target.served.kind, &rv.to_string());
        Bytes::from(event_line("BOOKMARK", &object))
    }
}

fn expired(asked: u64, floor: u64, rev: u64) -> Bytes {
    let error = Error::Expired(format!(
        "too old resource version: {asked} ({floor}); the node's history holds {floor}..{rev}"
    ));
    Bytes::from(event_line("ERROR", &error.status()))
}

/// Answers a watch request.
pub(crate) async fn respond(
    shared: Arc<Shared>,
    target: Target,
    params: &HashMap<String, String>,
    as_table: bool,
    include: table::Include,
) -> Response {
    let selectors = match selectors(params) {
        Ok(s) => s,
        Err(e) => return error_response(&e),
    };
    let from = match params.get("resourceVersion").filter(|r| !r.is_empty()) {
        None => 0,
        Some(text) => match text.parse::<u64>() {
            Ok(rv) => rv,
            Err(_) => {
                return error_response(&Error::BadRequest(format!(
                    "invalid resourceVersion {text:?}: the node's versions are numbers"
                )))
            }
        },
    };
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(shared.watch_timeout, Duration::from_secs);
    let bookmarks = params
        .get("allowWatchBookmarks")
        .is_some_and(|b| b == "true");
    let render = Render {
        target,
        selectors,
        as_table,
        include,
    };
    // Subscribed before the store is read: nothing committed after the read can be missed.
    let live = shared.changes.subscribe();
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(LINES);
    let start = match start(&shared, &render, from).await {
        Ok(start) => start,
        Err(e) => return error_response(&e),
    };
    tokio::spawn(stream(shared, render, start, live, tx, timeout, bookmarks));
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .unwrap_or_else(|_| error_response(&Error::BadRequest("watch".into())))
}

/// What a watch sends first, and the version it reached.
enum Start {
    Lines(Vec<Bytes>, u64),
    Expired(Bytes),
}

async fn start(shared: &Shared, render: &Render, from: u64) -> Result<Start, Error> {
    let res_type = render.target.served.res_type;
    if from == 0 {
        let page = shared
            .reader
            .list(ListQuery {
                res_type: res_type.to_owned(),
                namespace: render.target.namespace.clone(),
                ..ListQuery::default()
            })
            .await?
            .unwrap_or_default();
        let lines = page
            .objects
            .iter()
            .filter_map(|o| render.object(Event::Added.as_str(), &o.key, &o.value, o.rv))
            .collect();
        return Ok(Start::Lines(lines, page.rev));
    }
    Ok(match shared.reader.since(res_type, from).await? {
        Since::Changes { changes, rev } => Start::Lines(
            changes.iter().filter_map(|c| render.change(c)).collect(),
            rev,
        ),
        Since::Expired { floor, rev } => Start::Expired(expired(from, floor, rev)),
    })
}

async fn stream(
    shared: Arc<Shared>,
    render: Render,
    start: Start,
    mut live: broadcast::Receiver<edgemeta_metamanager::store::Changes>,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
    timeout: Duration,
    bookmarks: bool,
) {
    let send = |line: Bytes| {
        let tx = tx.clone();
        async move { tx.send(Ok(line)).await.is_ok() }
    };
    let mut cursor = match start {
        Start::Expired(line) => {
            send(line).await;
            return;
        }
        Start::Lines(lines, rev) => {
            for line in lines {
                if !send(line).await {
                    return;
                }
            }
            rev
        }
    };
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let mut ticker = tokio::time::interval(shared.bookmark_interval);
    ticker.tick().await;
    loop {
        tokio::select! {
            () = shared.cancel.cancelled() => break,
            () = &mut deadline => {
                if bookmarks {
                    send(render.bookmark(cursor)).await;
                }
                break;
            }
            () = tx.closed() => break,
            _ = ticker.tick(), if bookmarks => {
                if !send(render.bookmark(cursor)).await {
                    break;
                }
            }
            batch = live.recv() => match batch {
                Ok(batch) => {
                    for change in batch.iter() {
                        if change.rv <= cursor {
                            continue;
                        }
                        cursor = change.rv;
                        if let Some(line) = render.change(change) {
                            if !send(line).await {
                                return;
                            }
                            shared.meters.watch_event(batch.at.elapsed());
                        }
                    }
                }
                // Behind the live channel: what was missed is read from the history.
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    match shared.reader.since(render.target.served.res_type, cursor).await {
                        Ok(Since::Changes { changes, rev }) => {
                            for change in changes.iter() {
                                if change.rv <= cursor {
                                    continue;
                                }
                                if let Some(line) = render.change(change) {
                                    if !send(line).await {
                                        return;
                                    }
                                }
                            }
                            cursor = cursor.max(rev);
                        }
                        Ok(Since::Expired { floor, rev }) => {
                            send(expired(cursor, floor, rev)).await;
                            break;
                        }
                        Err(e) => {
                            tracing::error!(error_code = "EM-METASERVER-READ", error = %e, "a watch could not catch up; closed");
                            break;
                        }
                    }
                }
                Err(broadcast::error::RecvError::Closed) => break,
            },
        }
    }
}
