//! Requests: the token check, discovery, `get` and `list` (paged with `limit`/`continue`), 405
//! for every write; watches go to `watch.rs`.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use edgemeta_kubewire::{kinds, table};
use edgemeta_metamanager::store::ListQuery;
use serde_json::{json, Value};
use tracing::debug;

use crate::error::{error_response, json_response};
use crate::kinds::{Served, Target};
use crate::object::{selectors, Object};
use crate::{watch, Error, Shared};

fn found(path: &str, body: Option<Value>) -> Response {
    match body {
        Some(body) => json_response(200, body.to_string()),
        None => error_response(&Error::NoResource(path.to_owned())),
    }
}

/// `/api/v1/...` → the target, or `None` when it names nothing served.
fn target(kinds: &'static [edgemeta_kubewire::Kind], segments: &[&str]) -> Option<Target> {
    let rest = match segments {
        ["api", "v1", rest @ ..] => rest,
        _ => return None,
    };
    let (served, namespace, tail) = match rest {
        ["namespaces", ns, plural, tail @ ..] => (Served::find(kinds, plural)?, Some(*ns), tail),
        [plural, tail @ ..] => (Served::find(kinds, plural)?, None, tail),
        _ => return None,
    };
    if tail.len() > 1 || (namespace.is_some() && !served.kind.namespaced) {
        return None;
    }
    Some(Target {
        served,
        namespace: namespace.map(str::to_owned),
        name: tail.first().map(|n| (*n).to_owned()),
    })
}

/// Constant-time comparison of the bearer token.
fn authorized(shared: &Shared, headers: &HeaderMap) -> bool {
    let Some(token) = &shared.token else {
        return true;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

/// Every request lands here.
pub(crate) async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    debug!(%method, %uri, "metaserver request");
    if !authorized(&shared, &headers) {
        return error_response(&Error::Unauthorized);
    }
    let path = uri.path().to_owned();
    if method != Method::GET && method != Method::HEAD {
        return error_response(&Error::MethodNotAllowed(method.to_string()));
    }
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let kinds = shared.kinds;
    match segments.as_slice() {
        ["version"] => return found(&path, Some(edgemeta_kubewire::version("v1.33.0-edgemeta"))),
        ["healthz" | "readyz" | "livez"] => return "ok".into_response(),
        ["api"] => return found(&path, Some(kinds::core_versions(&shared.address))),
        ["apis"] => return found(&path, Some(kinds::groups(kinds))),
        ["api", version] => {
            return found(
                &path,
                kinds::resources(kinds, kinds::READ_ONLY, "", version),
            )
        }
        _ => {}
    }
    let Some(target) = target(kinds, &segments) else {
        return error_response(&Error::NoResource(path));
    };
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .unwrap_or_default();
    let as_table = table::wanted(accept);
    let include = table::Include::from_param(params.get("includeObject").map(String::as_str));
    let watching = params.get("watch").is_some_and(|w| w == "true" || w == "1");
    let result = match &target.name {
        None if watching => {
            return watch::respond(shared, target, &params, as_table, include).await
        }
        None => list(&shared, &target, &params, as_table, include).await,
        Some(name) => get(&shared, &target, name, as_table, include).await,
    };
    match result {
        Ok(body) => json_response(200, body),
        Err(e) => error_response(&e),
    }
}

/// The name level of a key (`<namespace>/<type>/<name>`).
fn key_name(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or_default()
}

async fn get(
    shared: &Shared,
    target: &Target,
    name: &str,
    as_table: bool,
    include: table::Include,
) -> Result<String, Error> {
    let kind = target.served.kind;
    let not_found = || Error::NotFound {
        kind: kind.plural.to_owned(),
        name: name.to_owned(),
    };
    let stored = match &target.namespace {
        Some(ns) => {
            let key = format!("{ns}/{}/{name}", target.served.res_type);
            shared.reader.get(&key).await?
        }
        // Cluster-scoped (the Node): stored under whatever namespace the cloud sent.
        None if !kind.namespaced => {
            let page = shared
                .reader
                .list(ListQuery {
                    res_type: target.served.res_type.to_owned(),
                    ..ListQuery::default()
                })
                .await?
                .unwrap_or_default();
            page.objects.into_iter().find(|o| key_name(&o.key) == name)
        }
        None => return Err(Error::NoResource(format!("{}/{name}", kind.plural))),
    };
    let stored = stored.ok_or_else(not_found)?;
    let object =
        Object::parse(kind, &stored.key, &stored.value, stored.rv).ok_or_else(not_found)?;
    if as_table {
        let rv = stored.rv.to_string();
        return Ok(table::of(kind, &[object.to_value()], &rv, None, include).to_string());
    }
    Ok(object.to_json())
}

/// A `continue` token: `<version of the first page>/<last key>`.
fn parse_continue(token: &str) -> Result<(u64, String), Error> {
    token
        .split_once('/')
        .and_then(|(rv, key)| Some((rv.parse().ok()?, key.to_owned())))
        .ok_or_else(|| Error::BadRequest(format!("continue key is not valid: {token}")))
}

const EXPIRED_CONTINUE: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.";

async fn list(
    shared: &Shared,
    target: &Target,
    params: &HashMap<String, String>,
    as_table: bool,
    include: table::Include,
) -> Result<String, Error> {
    let kind = target.served.kind;
    let selectors = selectors(params)?;
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let (at, after) = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let (rv, key) = parse_continue(token)?;
            (Some(rv), Some(key))
        }
        None => (None, None),
    };
    let query = ListQuery {
        res_type: target.served.res_type.to_owned(),
        namespace: target.namespace.clone(),
        after,
        // With selectors, the page is cut after filtering.
        limit: if selectors.any() { None } else { limit },
        at,
    };
    let page = shared
        .reader
        .list(query)
        .await?
        .ok_or_else(|| Error::Expired(EXPIRED_CONTINUE.to_owned()))?;
    let mut objects = Vec::new();
    let mut last_key = None;
    let mut more = page.more;
    for stored in &page.objects {
        if limit.is_some_and(|l| objects.len() >= l) {
            more = true;
            break;
        }
        if let Some(object) = Object::parse(kind, &stored.key, &stored.value, stored.rv) {
            if selectors.matches(&object) {
                objects.push(object);
            }
        }
        last_key = Some(stored.key.as_str());
    }
    let cont = more
        .then_some(last_key)
        .flatten()
        .map(|key| format!("{}/{key}", page.rev));
    let rev = page.rev;
    let rev = rev.to_string();
    if as_table {
        let values: Vec<Value> = objects.iter().map(Object::to_value).collect();
        return Ok(table::of(kind, &values, &rev, cont.as_deref(), include).to_string());
    }
    let mut metadata = json!({"resourceVersion": rev});
    if let Some(c) = &cont {
        metadata["continue"] = json!(c);
    }
    let mut out = String::with_capacity(64 + objects.len() * 1024);
    out.push_str("{\"kind\":");
    out.push_str(&json!(format!("{}List", kind.kind)).to_string());
    out.push_str(",\"apiVersion\":\"v1\",\"metadata\":");
    out.push_str(&metadata.to_string());
    out.push_str(",\"items\":[");
    for (i, object) in objects.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        object.write(&mut out);
    }
    out.push_str("]}");
    Ok(out)
}
