//! The operator's commands. `get` reads the store read-only (safe beside a running node, whose
//! WAL it sees); `status` asks the running node's `/readyz` and `/metrics`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use edgemeta_metamanager::store::{read_meta, MetaRow};
use serde_json::Value;
use yaml_rust2::{Yaml, YamlEmitter};

use crate::config::Settings;

/// How `get` prints what it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

/// How long `status` waits for each answer from the node.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// Prints the objects `selector` names; `false` when a named object is not there.
pub fn get(settings: &Settings, selector: &str, output: Output) -> anyhow::Result<bool> {
    let parts: Vec<&str> = selector.split('/').collect();
    let list = match parts.as_slice() {
        [ns, ty] if !ns.is_empty() && !ty.is_empty() => true,
        [ns, ty, name] if !ns.is_empty() && !ty.is_empty() && !name.is_empty() => false,
        _ => anyhow::bail!("expected <namespace>/<type>[/<name>], got {selector:?}"),
    };
    let path = &settings.store.path;
    let rows = tokio::runtime::Builder::new_current_thread()
        .build()?
        .block_on(read_meta(path, selector, list))
        .with_context(|| format!("reading the store {}", path.display()))?;
    if rows.is_empty() {
        if list {
            eprintln!("No resources found for {selector}.");
            return Ok(true);
        }
        eprintln!("{selector} not found");
        return Ok(false);
    }
    let documents = || rows.iter().map(|r| document(&r.value));
    let text = match (output, list) {
        (Output::Table, _) => table(&rows),
        (Output::Json, true) => json_text(&Value::Array(documents().collect()))?,
        (Output::Json, false) => json_text(&document(&rows[0].value))?,
        (Output::Yaml, true) => yaml_text(&Value::Array(documents().collect()))?,
        (Output::Yaml, false) => yaml_text(&document(&rows[0].value))?,
    };
    print!("{text}");
    Ok(true)
}

/// A stored value as JSON: documents are JSON text; anything else is shown as a string.
fn document(value: &str) -> Value {
    serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()))
}

fn json_text(value: &Value) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

fn yaml_text(value: &Value) -> anyhow::Result<String> {
    let mut out = String::new();
    YamlEmitter::new(&mut out).dump(&to_yaml(value))?;
    out.push('\n');
    Ok(out)
}

fn to_yaml(value: &Value) -> Yaml {
    match value {
        Value::Null => Yaml::Null,
        Value::Bool(b) => Yaml::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Yaml::Integer(i),
            None => Yaml::Real(n.to_string()),
        },
        Value::String(s) => Yaml::String(s.clone()),
        Value::Array(items) => Yaml::Array(items.iter().map(to_yaml).collect()),
        Value::Object(map) => Yaml::Hash(
            map.iter()
                .map(|(k, v)| (Yaml::String(k.clone()), to_yaml(v)))
                .collect(),
        ),
    }
}

/// `NAMESPACE TYPE NAME SIZE`, columns as wide as their widest cell, like `kubectl get`.
fn table(rows: &[MetaRow]) -> String {
    let mut cells = vec![[
        "NAMESPACE".to_owned(),
        "TYPE".to_owned(),
        "NAME".to_owned(),
        "SIZE".to_owned(),
    ]];
    for row in rows {
        let mut parts = row.key.splitn(3, '/');
        let namespace = parts.next().unwrap_or_default().to_owned();
        let _ = parts.next();
        let name = parts.next().unwrap_or_default().to_owned();
        cells.push([
            namespace,
            row.res_type.clone(),
            name,
            row.value.len().to_string(),
        ]);
    }
    let widths: Vec<usize> = (0..4)
        .map(|c| cells.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &cells {
        let line = format!(
            "{:w0$}   {:w1$}   {:w2$}   {}",
            row[0],
            row[1],
            row[2],
            row[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

/// Prints the node's state from its endpoints; `true` when it is ready.
pub fn status(settings: &Settings) -> anyhow::Result<bool> {
    let address = edgemeta_broker::reachable(settings.observe.address);
    if !settings.observe.enabled {
        println!("observe is disabled in the configuration: nothing to ask");
        return Ok(false);
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(ASK_TIMEOUT))
        .build()
        .into();
    let ask = |path: &str| -> anyhow::Result<(u16, String)> {
        let url = format!("http://{address}{path}");
        let mut response = agent
            .get(&url)
            .call()
            .with_context(|| format!("no answer from {url}: is the node running?"))?;
        let body = response.body_mut().read_to_string()?;
        Ok((response.status().as_u16(), body))
    };
    let (code, readyz) = match ask("/readyz") {
        Ok(answer) => answer,
        Err(e) => {
            println!("node        {address}  UNREACHABLE ({e:#})");
            return Ok(false);
        }
    };
    let ready_json: Value = serde_json::from_str(&readyz)
        .with_context(|| format!("/readyz answered {code} with no JSON: {readyz}"))?;
    let ready = code == 200 && ready_json["ready"] == Value::Bool(true);
    let metrics = ask("/metrics").map(|(_, body)| gauges(&body))?;
    let metric = |name: &str| metrics.get(name).copied().unwrap_or(0.0);

    println!(
        "node        {address}  {}",
        if ready { "READY" } else { "NOT READY" }
    );
    for (name, listener) in &settings.broker.listeners {
        let up = ready_json["checks"]["listeners"]["ok"] == Value::Bool(true);
        println!(
            "listener    {name} {} ({})",
            listener.address,
            if up { "up" } else { "down" }
        );
    }
    println!(
        "connections {}",
        metric("edgemeta_broker_connections") as u64
    );
    if settings.cloud.enabled {
        let connected = ready_json["cloud"]["connected"] == Value::Bool(true);
        println!(
            "cloud       {} {}, reconnects {}",
            settings.cloud.url,
            if connected {
                "connected"
            } else {
                "NOT CONNECTED"
            },
            metric("edgemeta_cloud_reconnects_total") as u64
        );
    } else {
        println!("cloud       disabled (standalone)");
    }
    let outbox = &ready_json["outbox"];
    let age = outbox["oldest_age_s"]
        .as_f64()
        .map_or("-".to_owned(), |a| format!("{a:.1} s"));
    println!(
        "outbox      {} entries, {} bytes, oldest {age}",
        outbox["entries"].as_u64().unwrap_or(0),
        outbox["bytes"].as_u64().unwrap_or(0),
    );
    println!(
        "store       {} ({} bytes)",
        settings.store.path.display(),
        metric("edgemeta_store_bytes") as u64
    );
    if let Some(checks) = ready_json["checks"].as_object() {
        for (name, check) in checks {
            let ok = check["ok"] == Value::Bool(true);
            println!(
                "check       {name}: {} ({})",
                if ok { "ok" } else { "FAILED" },
                check["detail"].as_str().unwrap_or_default()
            );
        }
    }
    Ok(ready)
}

/// The unlabelled samples of a Prometheus text exposition, by name: `status` needs a few
/// gauges, so a full parser (and its dependencies) stays out of the node's binary.
fn gauges(exposition: &str) -> HashMap<String, f64> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (name, value) = line.split_once(' ')?;
            if name.contains('{') {
                return None;
            }
            Some((name.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}
