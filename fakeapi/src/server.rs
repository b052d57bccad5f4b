//! The HTTP side: path parsing into (kind, namespace, name, subresource), the verbs, watches as
//! chunked JSON lines, and the `/fake/...` knobs.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::kinds::{self, Kind};
use crate::store::{merge_patch, Change, Store};
use crate::{Config, Error, Faults};
use edgemeta_kubewire::{table, FieldSelector, LabelSelector};

/// What every request handler shares.
pub(crate) struct Shared {
    pub store: Mutex<Store>,
    pub faults: Mutex<Faults>,
    /// Bumped to end every open watch (the `drop_watches` knob).
    pub drops: watch::Sender<u64>,
    pub config: Config,
    pub cancel: CancellationToken,
    pub address: String,
}

impl Shared {
    pub fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A request's target after the `/api/v1` or `/apis/<g>/<v>` prefix.
struct Target {
    kind: &'static Kind,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn json_response(code: u16, body: &Value) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn error_response(error: &Error) -> Response {
    json_response(error.code(), &error.status())
}

fn not_found(path: &str) -> Response {
    json_response(
        404,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("the server could not find the requested resource ({path})"),
                "reason": "NotFound", "details": {}, "code": 404}),
    )
}

/// Splits `/api/v1/...` or `/apis/<g>/<v>/...` into the target, or `None` when it names no
/// served resource.
fn target(shared: &Shared, segments: &[&str]) -> Option<Target> {
    let (group, version, rest) = match segments {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let find = |plural: &str| {
        kinds::find(group, version, plural)
            .or_else(|| shared.store().crds.find(group, version, plural))
    };
    let (kind, namespace, name, sub) = match rest {
        ["namespaces", ns, plural, tail @ ..] => {
            (find(plural)?, Some(*ns), tail.first(), tail.get(1))
        }
        [plural, tail @ ..] => (find(plural)?, None, tail.first(), tail.get(1)),
        _ => return None,
    };
    let status = match sub {
        None => false,
        Some(&"status") if kind.status => true,
        Some(_) => return None,
    };
    if namespace.is_some() && !kind.namespaced {
        return None;
    }
    Some(Target {
        kind,
        namespace: namespace.map(str::to_owned),
        name: name.map(|n| (*n).to_owned()),
        status,
    })
}

/// The built-in kinds and the custom ones served now.
fn served(shared: &Shared) -> Vec<Kind> {
    shared.store().crds.with(kinds::KINDS)
}

/// Every request lands here.
pub(crate) async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    debug!(%method, %uri, "request");
    if let Some(knob) = path.strip_prefix("/fake/") {
        return fake(&shared, &method, knob, &body);
    }
    let latency = shared.faults().latency_ms;
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match (method.as_str(), segments.as_slice()) {
        ("GET", ["version"]) => {
            return json_response(200, &edgemeta_kubewire::version("v1.33.0-edgemeta-fake"))
        }
        ("GET", ["healthz" | "readyz" | "livez"]) => return "ok".into_response(),
        ("GET", ["api"]) => return json_response(200, &kinds::core_versions(&shared.address)),
        ("GET", ["apis"]) => return json_response(200, &kinds::groups(&served(&shared))),
        ("GET", ["apis", group]) => {
            return match kinds::group(&served(&shared), group) {
                Some(g) => json_response(200, &g),
                None => not_found(&path),
            }
        }
        ("GET", ["api", version]) => {
            return match kinds::resources(kinds::KINDS, kinds::READ_WRITE, "", version) {
                Some(r) => json_response(200, &r),
                None => not_found(&path),
            }
        }
        ("GET", ["apis", group, version]) => {
            return match kinds::resources(&served(&shared), kinds::READ_WRITE, group, version) {
                Some(r) => json_response(200, &r),
                None => not_found(&path),
            }
        }
        _ => {}
    }
    let Some(target) = target(&shared, &segments) else {
        return not_found(&path);
    };
    let watching = params.get("watch").is_some_and(|w| w == "true" || w == "1");
    if !watching {
        let mut faults = shared.faults();
        if faults.fail_requests > 0 {
            faults.fail_requests -= 1;
            let code = faults.fail_code;
            drop(faults);
            return error_response(&Error::Injected(code));
        }
    }
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    // Protobuf and CBOR bodies are not understood: 415 makes client-go fall back to JSON.
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .unwrap_or("application/json");
    if !body.is_empty() && !content_type.contains("json") {
        return error_response(&Error::UnsupportedMediaType);
    }
    let result = match (&method, target.name.is_some()) {
        (&Method::GET, false) if watching => {
            return watch_response(shared, target, &params, &accept)
        }
        (&Method::GET, false) => list(&shared, &target, &params, &accept),
        (&Method::GET, true) => get(&shared, &target, &params, &accept),
        (&Method::POST, false) => create(&shared, &target, &params, &body),
        (&Method::PUT, true) => update(&shared, &target, &body),
        (&Method::PATCH, true) => patch(&shared, &target, &headers, &body),
        (&Method::DELETE, true) => delete(&shared, &target, &params, &body),
        _ => Err(Error::MethodNotAllowed),
    };
    match result {
        Ok((code, value)) => json_response(code, &value),
        Err(e) => error_response(&e),
    }
}

fn parse_body(body: &Bytes) -> Result<Value, Error> {
    serde_json::from_slice(body)
        .map_err(|e| Error::BadRequest(format!("the request body is not JSON: {e}")))
}

fn namespace_of(target: &Target) -> String {
    target.namespace.clone().unwrap_or_default()
}

fn include(params: &HashMap<String, String>) -> table::Include {
    table::Include::from_param(params.get("includeObject").map(String::as_str))
}

fn get(
    shared: &Shared,
    target: &Target,
    params: &HashMap<String, String>,
    accept: &str,
) -> Result<(u16, Value), Error> {
    let name = target.name.as_deref().unwrap_or_default();
    let object = shared
        .store()
        .get(target.kind, &namespace_of(target), name)?;
    if table::wanted(accept) {
        let rv = object["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        return Ok((
            200,
            table::of(target.kind, &[object], &rv, None, include(params)),
        ));
    }
    Ok((200, object))
}

fn selectors(params: &HashMap<String, String>) -> Result<(LabelSelector, FieldSelector), Error> {
    let labels = LabelSelector::parse(params.get("labelSelector").map_or("", String::as_str))?;
    let fields = FieldSelector::parse(params.get("fieldSelector").map_or("", String::as_str))?;
    Ok((labels, fields))
}

/// A list, paged with `limit` and `continue` (`<rv>|<namespace>|<name>` of the last item).
fn list(
    shared: &Shared,
    target: &Target,
    params: &HashMap<String, String>,
    accept: &str,
) -> Result<(u16, Value), Error> {
    let (labels, fields) = selectors(params)?;
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let store = shared.store();
    let (rv, after) = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let mut parts = token.splitn(3, '|');
            let rv = parts.next().and_then(|r| r.parse::<u64>().ok());
            let (Some(rv), Some(ns), Some(name)) = (rv, parts.next(), parts.next()) else {
                return Err(Error::BadRequest(format!(
                    "continue key is not valid: {token}"
                )));
            };
            if rv < store.floor() {
                return Err(Error::Expired(
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.".to_owned(),
                ));
            }
            (rv, Some((ns.to_owned(), name.to_owned())))
        }
        None => (store.rv(), None),
    };
    let all = store.list(
        target.kind,
        target.namespace.as_deref(),
        after.as_ref().map(|(a, b)| (a.as_str(), b.as_str())),
    );
    drop(store);
    let mut items = Vec::new();
    let mut cont = None;
    let mut remaining = 0usize;
    for (ns, name, object) in all {
        if !labels.matches(&object) || !fields.matches(&object) {
            continue;
        }
        if limit.is_some_and(|l| items.len() >= l) {
            if cont.is_none() {
                let (last_ns, last_name) = items
                    .last()
                    .map(|(n, m, _): &(String, String, Value)| (n.clone(), m.clone()))
                    .unwrap_or((ns, name));
                cont = Some(format!("{rv}|{last_ns}|{last_name}"));
            }
            remaining += 1;
            continue;
        }
        items.push((ns, name, object));
    }
    let objects: Vec<Value> = items.into_iter().map(|(_, _, o)| o).collect();
    let rv = rv.to_string();
    if table::wanted(accept) {
        return Ok((
            200,
            table::of(target.kind, &objects, &rv, cont.as_deref(), include(params)),
        ));
    }
    let items: Vec<Value> = objects
        .into_iter()
        .map(|mut o| {
            if let Some(map) = o.as_object_mut() {
                map.remove("apiVersion");
                map.remove("kind");
            }
            o
        })
        .collect();
    let mut metadata = json!({"resourceVersion": rv});
    if let Some(c) = cont {
        metadata["continue"] = json!(c);
        metadata["remainingItemCount"] = json!(remaining);
    }
    Ok((
        200,
        json!({"kind": format!("{}List", target.kind.kind), "apiVersion": target.kind.api_version(),
               "metadata": metadata, "items": items}),
    ))
}

fn create(
    shared: &Shared,
    target: &Target,
    params: &HashMap<String, String>,
    body: &Bytes,
) -> Result<(u16, Value), Error> {
    let object = parse_body(body)?;
    if params.contains_key("dryRun") {
        return Ok((201, object));
    }
    let created = shared
        .store()
        .create(target.kind, &namespace_of(target), object)?;
    Ok((201, created))
}

fn update(shared: &Shared, target: &Target, body: &Bytes) -> Result<(u16, Value), Error> {
    let object = parse_body(body)?;
    let name = target.name.as_deref().unwrap_or_default();
    let updated = shared.store().update(
        target.kind,
        &namespace_of(target),
        name,
        object,
        target.status,
    )?;
    Ok((200, updated))
}

fn patch(
    shared: &Shared,
    target: &Target,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(u16, Value), Error> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .unwrap_or_default();
    let json_patch = content_type.starts_with("application/json-patch+json");
    if !json_patch
        && !content_type.starts_with("application/merge-patch+json")
        && !content_type.starts_with("application/strategic-merge-patch+json")
    {
        return Err(Error::UnsupportedMediaType);
    }
    let patch = parse_body(body)?;
    let name = target.name.as_deref().unwrap_or_default();
    let namespace = namespace_of(target);
    let mut store = shared.store();
    let mut object = store.get(target.kind, &namespace, name)?;
    let current_rv = object["metadata"]["resourceVersion"].clone();
    let keeps_rv = if json_patch {
        apply_json_patch(&mut object, patch)?;
        object["metadata"]["resourceVersion"] == current_rv
    } else {
        merge_patch(&mut object, &patch);
        patch["metadata"]["resourceVersion"].is_null()
    };
    // A patch that leaves the resourceVersion alone applies to whatever is stored; one that
    // sets it is a precondition, checked by the update.
    if keeps_rv {
        object["metadata"]["resourceVersion"] = current_rv;
    }
    let updated = store.update(target.kind, &namespace, name, object, target.status)?;
    Ok((200, updated))
}

/// RFC 6902: the operations in order, all or nothing (`json_patch::patch` undoes a partial one).
/// A body that is not a list of operations is a 400; an operation that fails (a `test` that does
/// not match, a path that is not there) a 422, as the API server answers both.
fn apply_json_patch(object: &mut Value, patch: Value) -> Result<(), Error> {
    let patch: json_patch::Patch = serde_json::from_value(patch).map_err(|e| {
        Error::BadRequest(format!("the JSON patch is not a list of operations: {e}"))
    })?;
    json_patch::patch(object, &patch)
        .map_err(|e| Error::Invalid(format!("the JSON patch cannot be applied: {e}")))
}

fn delete(
    shared: &Shared,
    target: &Target,
    params: &HashMap<String, String>,
    body: &Bytes,
) -> Result<(u16, Value), Error> {
    let options = if body.is_empty() {
        Value::Null
    } else {
        parse_body(body)?
    };
    let grace = options["gracePeriodSeconds"].as_i64().or_else(|| {
        params
            .get("gracePeriodSeconds")
            .and_then(|g| g.parse().ok())
    });
    let uid = options["preconditions"]["uid"].as_str();
    let rv = options["preconditions"]["resourceVersion"].as_str();
    let name = target.name.as_deref().unwrap_or_default();
    let gone = shared
        .store()
        .delete(target.kind, &namespace_of(target), name, grace, uid, rv)?;
    Ok((200, gone))
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    Bytes::from(edgemeta_kubewire::event_line(kind, object))
}

/// Whether a change belongs to this watch.
fn selected(
    change: &Change,
    target: &Target,
    labels: &LabelSelector,
    fields: &FieldSelector,
) -> bool {
    change.resource == target.kind.resource()
        && target
            .namespace
            .as_ref()
            .is_none_or(|ns| *ns == change.namespace)
        && labels.matches(&change.object)
        && fields.matches(&change.object)
}

/// A watch: HTTP 200 and one JSON event per line until `timeoutSeconds`, a dropped watch, or
/// the client leaving. A version older than the history gets an `ERROR` event with a 410
/// Status, as the API server does (kube-rs relists only on that).
fn watch_response(
    shared: Arc<Shared>,
    target: Target,
    params: &HashMap<String, String>,
    accept: &str,
) -> Response {
    let (labels, fields) = match selectors(params) {
        Ok(s) => s,
        Err(e) => return error_response(&e),
    };
    let from = params
        .get("resourceVersion")
        .and_then(|r| r.parse::<u64>().ok())
        .filter(|r| *r > 0);
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(shared.config.watch_timeout, Duration::from_secs);
    let bookmarks = params
        .get("allowWatchBookmarks")
        .is_some_and(|b| b == "true");
    let as_table = table::wanted(accept);
    let rows = include(params);
    let forced_expiry = {
        let mut faults = shared.faults();
        let forced = faults.expire_watches > 0;
        faults.expire_watches = faults.expire_watches.saturating_sub(1);
        forced
    };
    let mut drops = shared.drops.subscribe();
    drops.mark_unchanged();
    let (mut changes, initial, expired, mut cursor) = {
        let store = shared.store();
        let changes = store.subscribe();
        let cursor = store.rv();
        match from {
            None => {
                let current: Vec<(&'static str, Value)> = store
                    .list(target.kind, target.namespace.as_deref(), None)
                    .into_iter()
                    .map(|(_, _, o)| o)
                    .filter(|o| labels.matches(o) && fields.matches(o))
                    .map(|o| ("ADDED", o))
                    .collect();
                (changes, current, false, cursor)
            }
            Some(rv) if rv < store.floor() || forced_expiry => (changes, Vec::new(), true, cursor),
            Some(rv) => {
                let replay = store
                    .since(rv)
                    .into_iter()
                    .filter(|c| selected(c, &target, &labels, &fields))
                    .map(|c| (c.kind, c.object.clone()))
                    .collect();
                (changes, replay, false, cursor)
            }
        }
    };
    let render = move |kind: &Kind, object: &Value| -> Value {
        if as_table {
            let rv = object["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            table::of(kind, std::slice::from_ref(object), &rv, None, rows)
        } else {
            object.clone()
        }
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(256);
    let bookmark_every = shared.config.bookmark_interval;
    let cancel = shared.cancel.clone();
    tokio::spawn(async move {
        if expired {
            let status = Error::Expired(format!(
                "too old resource version: {} ({})",
                from.unwrap_or_default(),
                cursor
            ))
            .status();
            let _ = tx.send(Ok(event_line("ERROR", &status))).await;
            return;
        }
        for (kind, object) in initial {
            if tx
                .send(Ok(event_line(kind, &render(target.kind, &object))))
                .await
                .is_err()
            {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticker = tokio::time::interval(bookmark_every);
        ticker.tick().await;
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                _ = drops.changed() => break,
                () = &mut deadline => break,
                () = tx.closed() => break,
                _ = ticker.tick(), if bookmarks => {
                    let object = edgemeta_kubewire::bookmark(target.kind, &cursor.to_string());
                    if tx.send(Ok(event_line("BOOKMARK", &object))).await.is_err() {
                        break;
                    }
                }
                change = changes.recv() => match change {
                    Ok(change) => {
                        if change.rv <= cursor {
                            continue;
                        }
                        cursor = change.rv;
                        if selected(&change, &target, &labels, &fields)
                            && tx.send(Ok(event_line(change.kind, &render(target.kind, &change.object)))).await.is_err()
                        {
                            break;
                        }
                    }
                    // Too far behind: end the watch; the client resumes from its last version.
                    Err(broadcast::error::RecvError::Lagged(_)) | Err(broadcast::error::RecvError::Closed) => break,
                },
            }
        }
    });
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .unwrap_or_else(|_| error_response(&Error::Injected(500)))
}

/// `POST /fake/faults` with any of `latency_ms`, `fail_requests` + `fail_code`,
/// `expire_watches`, `drop_watches`, `compact`; `GET /fake/stats`.
fn fake(shared: &Shared, method: &Method, knob: &str, body: &Bytes) -> Response {
    match (method.as_str(), knob) {
        ("POST", "faults") => {
            let request = match parse_body(body) {
                Ok(r) => r,
                Err(e) => return error_response(&e),
            };
            {
                let mut faults = shared.faults();
                if let Some(ms) = request["latency_ms"].as_u64() {
                    faults.latency_ms = ms;
                }
                if let Some(n) = request["expire_watches"].as_u64() {
                    faults.expire_watches = u32::try_from(n).unwrap_or(u32::MAX);
                }
                if let Some(n) = request["fail_requests"].as_u64() {
                    faults.fail_requests = u32::try_from(n).unwrap_or(u32::MAX);
                    faults.fail_code = request["fail_code"]
                        .as_u64()
                        .and_then(|c| u16::try_from(c).ok())
                        .unwrap_or(500);
                }
            }
            if request["compact"] == true {
                shared.store().compact();
            }
            if request["drop_watches"] == true {
                shared.drops.send_modify(|n| *n += 1);
            }
            json_response(200, &json!({"ok": true}))
        }
        ("GET", "stats") => {
            let store = shared.store();
            json_response(
                200,
                &json!({"resourceVersion": store.rv(), "floor": store.floor(),
                        "writes": store.writes}),
            )
        }
        _ => not_found(knob),
    }
}
