//! kubelet's `/metrics/resource` (what metrics-server scrapes for `kubectl top`): CPU and
//! memory per container, per pod and for the node, read from /proc. A container is a process
//! group here, so its figures are the sums over the group's processes.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::SystemTime;

/// One container's process group as the pod directory records it.
pub struct ContainerRef {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// `<pod dir>/<container>.pid`: `<pgid> <start time in clock ticks>`.
    pub pid_file: std::path::PathBuf,
}

/// CPU seconds and resident bytes of a set of processes, and when the group started.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Usage {
    cpu_seconds: f64,
    memory_bytes: u64,
}

/// What `/proc/<pid>/stat` says of one process.
struct ProcStat {
    pgrp: u32,
    ticks: u64,
    rss_pages: u64,
}

fn proc_stat(text: &str) -> Option<ProcStat> {
    // Field 2 (the command) is in parentheses and may contain spaces: count after it.
    let after = text.get(text.rfind(')')? + 2..)?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): field n is fields[n - 3].
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    // utime + stime, and cutime + cstime: the children it waited for (a shell's `sleep`s) count,
    // as a cgroup counts them.
    Some(ProcStat {
        pgrp: u32::try_from(field(5)?).ok()?,
        ticks: field(14)? + field(15)? + field(16)? + field(17)?,
        rss_pages: field(24)?,
    })
}

/// Usage per process group, for the groups in `wanted`. Blocking (reads /proc).
fn group_usage(wanted: &[u32]) -> HashMap<u32, Usage> {
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let page = rustix::param::page_size() as u64;
    let mut usage: HashMap<u32, Usage> = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return usage;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(stat) = proc_stat(&text) else {
            continue;
        };
        if wanted.contains(&stat.pgrp) {
            let u = usage.entry(stat.pgrp).or_default();
            u.cpu_seconds += stat.ticks as f64 / ticks;
            u.memory_bytes += stat.rss_pages * page;
        }
    }
    usage
}

/// `(pgid, start time in ticks since boot)` from a pid file.
fn read_pid_file(path: &Path) -> Option<(u32, u64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut parts = text.split_whitespace();
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// A value of `/proc/meminfo` in bytes.
fn meminfo(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line
        .get(key.len()..)?
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Busy CPU seconds of the host (`/proc/stat`'s `cpu` line less idle and iowait) and its boot
/// time (`btime`).
fn host_cpu(text: &str) -> (Option<f64>, Option<u64>) {
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let cpu = text.lines().find(|l| l.starts_with("cpu ")).map(|l| {
        let v: Vec<u64> = l
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest is inside user).
        let busy: u64 = v
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(i, 0 | 1 | 2 | 5 | 6 | 7))
            .map(|(_, n)| n)
            .sum();
        busy as f64 / ticks
    });
    let boot = text
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|b| b.trim().parse().ok());
    (cpu, boot)
}

/// The scrape: Prometheus text as kubelet's resource metrics endpoint writes it. Blocking.
pub fn render(containers: &[ContainerRef]) -> String {
    let now_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let groups: Vec<Option<(u32, u64)>> = containers
        .iter()
        .map(|c| read_pid_file(&c.pid_file))
        .collect();
    let wanted: Vec<u32> = groups.iter().flatten().map(|(p, _)| *p).collect();
    let usage = group_usage(&wanted);
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let (node_cpu, boot) = host_cpu(&stat);
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();

    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, lines: &[(String, String)]| {
        let _ = writeln!(out, "# HELP {name} [STABLE] {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in lines {
            let _ = writeln!(out, "{name}{labels} {value} {now_ms}");
        }
    };
    let label = |c: &ContainerRef| {
        format!(
            "{{container=\"{}\",namespace=\"{}\",pod=\"{}\"}}",
            c.container, c.namespace, c.pod
        )
    };
    let mut cpu = Vec::new();
    let mut memory = Vec::new();
    let mut started = Vec::new();
    let mut pods: Vec<((String, String), Usage)> = Vec::new();
    for (c, group) in containers.iter().zip(&groups) {
        let Some((pgid, start_ticks)) = group else {
            continue;
        };
        let u = usage.get(pgid).copied().unwrap_or_default();
        cpu.push((label(c), format!("{:.6}", u.cpu_seconds)));
        memory.push((label(c), u.memory_bytes.to_string()));
        if let Some(boot) = boot {
            let at = boot as f64 + *start_ticks as f64 / ticks;
            started.push((label(c), format!("{at:.3}")));
        }
        let key = (c.namespace.clone(), c.pod.clone());
        match pods.iter_mut().find(|(k, _)| *k == key) {
            Some((_, sum)) => {
                sum.cpu_seconds += u.cpu_seconds;
                sum.memory_bytes += u.memory_bytes;
            }
            None => pods.push((key, u)),
        }
    }
    family(
        "container_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
        &cpu,
    );
    family(
        "container_memory_working_set_bytes",
        "gauge",
        "Current working set of the container in bytes",
        &memory,
    );
    family(
        "container_start_time_seconds",
        "gauge",
        "Start time of the container since unix epoch in seconds",
        &started,
    );
    if let Some(cpu) = node_cpu {
        family(
            "node_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed by the node in core-seconds",
            &[(String::new(), format!("{cpu:.6}"))],
        );
    }
    if let (Some(total), Some(available)) =
        (meminfo(&mem, "MemTotal"), meminfo(&mem, "MemAvailable"))
    {
        family(
            "node_memory_working_set_bytes",
            "gauge",
            "Current working set of the node in bytes",
            &[(String::new(), total.saturating_sub(available).to_string())],
        );
    }
    let pod_label = |(ns, pod): &(String, String)| format!("{{namespace=\"{ns}\",pod=\"{pod}\"}}");
    let pod_cpu: Vec<(String, String)> = pods
        .iter()
        .map(|(k, u)| (pod_label(k), format!("{:.6}", u.cpu_seconds)))
        .collect();
    let pod_memory: Vec<(String, String)> = pods
        .iter()
        .map(|(k, u)| (pod_label(k), u.memory_bytes.to_string()))
        .collect();
    family(
        "pod_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
        &pod_cpu,
    );
    family(
        "pod_memory_working_set_bytes",
        "gauge",
        "Current working set of the pod in bytes",
        &pod_memory,
    );
    let _ = writeln!(
        out,
        "# HELP scrape_error [ALPHA] 1 if there was an error while getting container metrics, 0 otherwise\n# TYPE scrape_error gauge\nscrape_error 0"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_with_spaces_in_the_name_parses() {
        let line = "4242 (my prog) S 1 4240 4240 0 -1 4194560 100 0 0 0 150 50 7 3 20 0 1 0 999 1000000 321 18446744073709551615";
        let s = proc_stat(line).expect("parses");
        assert_eq!((s.pgrp, s.ticks, s.rss_pages), (4240, 210, 321));
    }

    #[test]
    fn host_figures_come_from_proc_stat_and_meminfo() {
        let (cpu, boot) = host_cpu("cpu  100 0 50 1000 7 0 0 0 0 0\ncpu0 1 2\nbtime 1700000000\n");
        let ticks = rustix::param::clock_ticks_per_second() as f64;
        assert_eq!(cpu, Some(150.0 / ticks));
        assert_eq!(boot, Some(1_700_000_000));
        let mem = "MemTotal:       2000 kB\nMemFree: 1 kB\nMemAvailable:   500 kB\n";
        assert_eq!(meminfo(mem, "MemTotal"), Some(2_048_000));
        assert_eq!(meminfo(mem, "MemAvailable"), Some(512_000));
    }

    #[test]
    fn this_process_group_is_measured() {
        let dir = tempfile::tempdir().expect("dir");
        let pid_file = dir.path().join("c.pid");
        let me = std::fs::read_to_string("/proc/self/stat").expect("stat");
        let pgrp = proc_stat(&me).expect("parses").pgrp;
        std::fs::write(&pid_file, format!("{pgrp} 1\n")).expect("pid");
        let text = render(&[ContainerRef {
            namespace: "default".to_owned(),
            pod: "web".to_owned(),
            container: "main".to_owned(),
            pid_file,
        }]);
        let memory = text
            .lines()
            .find(|l| l.starts_with("container_memory_working_set_bytes{"))
            .expect("memory line");
        assert!(memory.contains("container=\"main\",namespace=\"default\",pod=\"web\""));
        let bytes: u64 = memory
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .expect("value");
        assert!(bytes > 0, "{text}");
        assert!(text.contains("\nnode_cpu_usage_seconds_total "), "{text}");
        assert!(text.contains("\npod_memory_working_set_bytes{namespace=\"default\",pod=\"web\"} "));
    }
}
