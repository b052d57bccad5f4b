//! Random desired-value edits, moves, deletions and node outages against the device state and
//! the acked delivery, with nodes that apply membership and twin messages as the MetaManager
//! does (versions included) over a lossy broker queue: every node ends with exactly its devices
//! at their latest desired values, and no node ever applies an older value after a newer one.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::Value;

use super::state::{device_id, DeviceSpec, Devices, Key, ModelSpec, Property};
use crate::delivery::{Delivery, Dispatch, Outgoing};
use crate::envelope::Envelope;

const NODES: usize = 2;
const DEVICES: usize = 3;

#[derive(Debug, Clone)]
enum Step {
    Edit(usize),
    Move(usize, Option<usize>),
    Delete(usize),
    Outage(usize),
    Back(usize),
    Deliver(usize),
    Tick,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..DEVICES).prop_map(Step::Edit),
        2 => (0..DEVICES, prop::option::weighted(0.8, 0..NODES)).prop_map(|(d, n)| Step::Move(d, n)),
        1 => (0..DEVICES).prop_map(Step::Delete),
        1 => (0..NODES).prop_map(Step::Outage),
        1 => (0..NODES).prop_map(Step::Back),
        8 => (0..NODES).prop_map(Step::Deliver),
        2 => Just(Step::Tick),
    ]
}

fn node_name(i: usize) -> String {
    format!("n{i}")
}

/// One simulated node: its devices' expected values with their cloud versions, and per device
/// the versions it applied since it last joined.
#[derive(Default)]
struct SimNode {
    queue: VecDeque<Envelope>,
    online: bool,
    devices: HashMap<String, (String, i64)>,
}

impl SimNode {
    /// Applies twins as the MetaManager does: a value whose cloud version is older than the
    /// stored one is refused.
    fn twins(&mut self, id: &str, twins: &Value) -> Result<(), TestCaseError> {
        let Some(stored) = self.devices.get_mut(id) else {
            return Ok(());
        };
        if let Some(twin) = twins.get("temp") {
            let (Some(value), Some(cloud)) = (
                twin["expected"]["value"].as_str(),
                twin["expected_version"]["cloud"].as_i64(),
            ) else {
                return Ok(());
            };
            if cloud >= stored.1 {
                prop_assert!(
                    value.parse::<i64>().ok() >= stored.0.parse::<i64>().ok(),
                    "{id}: {value} applied after {}",
                    stored.0
                );
                *stored = (value.to_owned(), cloud);
            }
        }
        Ok(())
    }

    fn apply(&mut self, e: &Envelope) -> Result<(), TestCaseError> {
        let c = &e.content;
        for d in c["added_devices"].as_array().into_iter().flatten() {
            let id = d["id"].as_str().unwrap_or_default().to_owned();
            self.devices
                .entry(id.clone())
                .or_insert(("0".to_owned(), 0));
            self.twins(&id, &d["twin"])?;
        }
        for d in c["removed_devices"].as_array().into_iter().flatten() {
            self.devices.remove(d["id"].as_str().unwrap_or_default());
        }
        if c.get("twin").is_some() {
            let mut parts = e.route.resource.splitn(3, '/');
            let (ns, _, name) = (parts.next(), parts.next(), parts.next());
            let id = format!("{}/{}", ns.unwrap_or_default(), name.unwrap_or_default());
            self.twins(&id, &c["twin"])?;
        }
        Ok(())
    }
}

struct World {
    now: Instant,
    rv: u64,
    delivery: Delivery,
    state: Devices,
    nodes: Vec<SimNode>,
    /// The truth: per device, its node and desired value (`None`: deleted).
    truth: Vec<Option<(Option<usize>, u64)>>,
}

impl World {
    fn publish(&mut self, sends: Vec<Dispatch>) {
        for send in sends {
            let i: usize = send.node[1..].parse().unwrap_or(0);
            let e = send.envelope().expect("an envelope");
            let queue = &mut self.nodes[i].queue;
            // The cloud broker's queue for an offline node is small: the oldest goes.
            if queue.len() >= 5 {
                queue.pop_front();
            }
            queue.push_back(e);
        }
    }

    fn submit(&mut self, outgoing: Vec<Outgoing>) {
        let mut sends = Vec::new();
        for out in outgoing {
            sends.extend(self.delivery.submit(out, self.now));
        }
        self.publish(sends);
    }

    fn spec(&mut self, d: usize, node: Option<usize>, value: u64) -> DeviceSpec {
        DeviceSpec {
            namespace: "default".to_owned(),
            name: format!("d{d}"),
            uid: format!("uid-{d}"),
            rv: self.rv,
            node: node.map(node_name),
            model: "thermo".to_owned(),
            description: String::new(),
            properties: vec![Property {
                name: "temp".to_owned(),
                desired: Some(value.to_string()),
            }],
            object: None,
        }
    }

    fn write(&mut self, d: usize, node: Option<usize>) {
        self.rv += 1;
        let value = self.rv;
        let spec = self.spec(d, node, value);
        self.truth[d] = Some((node, value));
        let sends = self.state.applied(spec, &self.delivery);
        self.submit(sends);
    }

    fn deliver(&mut self, i: usize) -> Result<(), TestCaseError> {
        let Some(e) = self.nodes[i].queue.pop_front() else {
            return Ok(());
        };
        self.nodes[i].apply(&e)?;
        let next = self.delivery.ack(&node_name(i), &e.header.msg_id, self.now);
        self.publish(next.into_iter().collect());
        Ok(())
    }

    fn back(&mut self, i: usize) {
        self.nodes[i].online = true;
        let sends = self.delivery.node_online(&node_name(i), self.now);
        self.publish(sends);
        let desired = self.state.desired(&node_name(i));
        self.submit(desired);
    }
}

proptest! {
    #[test]
    fn nodes_converge_to_their_devices_latest_desired_values(steps in prop::collection::vec(step(), 1..250)) {
        let mut w = World {
            now: Instant::now(),
            rv: 0,
            delivery: Delivery::new(Duration::from_millis(100), Duration::from_secs(2)),
            state: Devices::default(),
            nodes: (0..NODES).map(|_| SimNode { online: true, ..SimNode::default() }).collect(),
            truth: vec![None; DEVICES],
        };
        let model = ModelSpec {
            namespace: "default".to_owned(),
            name: "thermo".to_owned(),
            types: vec![("temp".to_owned(), "INT".to_owned())],
            object: None,
        };
        w.state.model_applied(model, &w.delivery);
        w.state.models_synced();
        for s in steps {
            w.now += Duration::from_millis(50);
            match s {
                Step::Edit(d) => {
                    let node = w.truth[d].and_then(|(n, _)| n);
                    w.write(d, node);
                }
                Step::Move(d, node) => w.write(d, node),
                Step::Delete(d) => {
                    w.truth[d] = None;
                    let key: Key = ("default".to_owned(), format!("d{d}"));
                    let sends = w.state.deleted(&key);
                    w.submit(sends);
                }
                Step::Outage(i) => {
                    w.nodes[i].online = false;
                    w.delivery.node_offline(&node_name(i));
                }
                Step::Back(i) => w.back(i),
                Step::Deliver(i) if w.nodes[i].online => w.deliver(i)?,
                Step::Deliver(_) => {}
                Step::Tick => {
                    let due = w.delivery.due(w.now);
                    w.publish(due);
                }
            }
        }
        // The nodes that are away come back (a birth message each); the others never resync.
        for i in 0..NODES {
            if !w.nodes[i].online {
                w.back(i);
            }
        }
        for _ in 0..2_000 {
            w.now += Duration::from_millis(500);
            for i in 0..NODES {
                w.deliver(i)?;
            }
            if w.nodes.iter().all(|n| n.queue.is_empty()) {
                let due = w.delivery.due(w.now);
                w.publish(due);
            }
        }
        prop_assert_eq!(w.delivery.in_flight(), 0);
        for (i, node) in w.nodes.iter().enumerate() {
            let want: HashMap<String, String> = w
                .truth
                .iter()
                .enumerate()
                .filter_map(|(d, t)| match t {
                    Some((Some(n), v)) if *n == i => {
                        Some((device_id(&("default".to_owned(), format!("d{d}"))), v.to_string()))
                    }
                    _ => None,
                })
                .collect();
            let have: HashMap<String, String> = node
                .devices
                .iter()
                .map(|(id, (v, _))| (id.clone(), v.clone()))
                .collect();
            prop_assert_eq!(have, want, "node n{}", i);
        }
    }
}
