//! One task per registered mapper: it keeps what the mapper holds (as far as the node knows:
//! the registration's lists, then every call that succeeded) and the latest wanted state of
//! each device and model, and makes one call at a time until the two agree. A newer state of a
//! device replaces an older one still waiting (the latest wins); a failed call is retried with
//! back-off, per device, while the others go on. A model goes before the first device using it
//! (mapper-framework refuses a device whose model it lacks).
//!
//! When the mapper registers again, the dispatcher before hands over: it makes no new call, and
//! the one it has running is answered (or times out) before the new registration's lists go to
//! the mapper, so that a call sent earlier cannot land on top of them. One that timed out may
//! still be applied: its object is sent again.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Status};
use tracing::{debug, warn};

use crate::pb;
use crate::pb::device_mapper_service_client::DeviceMapperServiceClient;
use crate::DmiConfig;

/// A device or model: `(namespace, name)`.
pub(crate) type Key = (String, String);

/// A device with its model, as the mapper should hold them.
pub(crate) type Wanted = (pb::Device, (Key, pb::DeviceModel));

/// The latest state of one object for the mapper.
pub(crate) enum Op {
    /// A device and its model, or `None`: the mapper should not have it.
    Device(Key, Option<Box<Wanted>>),
    /// A model changed (`Some`) or is gone from the node.
    Model(Key, Option<pb::DeviceModel>),
}

/// The object of a call that timed out while its dispatcher handed over: the mapper may apply
/// it still, so what it holds of that object is not known.
pub(crate) struct Unsettled(Target);

/// A new registration's start: the dispatcher before it (if the mapper registered already),
/// and the answer to the registration, sent once that one has ended.
pub(crate) struct Handover {
    /// The dispatcher before, its channel closed: it ends once its running call is answered.
    pub previous: Option<JoinHandle<Option<Unsettled>>>,
    /// Each listed device with its model, as the answer lists them.
    pub listed: HashMap<Key, Wanted>,
    pub reply: oneshot::Sender<Result<pb::MapperRegisterResponse, Status>>,
    pub response: pb::MapperRegisterResponse,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Target {
    Device(Key),
    Model(Key),
}

enum Want {
    Device(Option<Box<Wanted>>),
    Model(Option<pb::DeviceModel>),
}

#[derive(Debug, Clone)]
enum Call {
    CreateModel(Key, pb::DeviceModel),
    UpdateModel(Key, pb::DeviceModel),
    RemoveModel(Key),
    Register(Key, pb::Device),
    Update(Key, pb::Device),
    Remove(Key),
}

impl Call {
    fn name(&self) -> &'static str {
        match self {
            Call::CreateModel(..) => "CreateDeviceModel",
            Call::UpdateModel(..) => "UpdateDeviceModel",
            Call::RemoveModel(..) => "RemoveDeviceModel",
            Call::Register(..) => "RegisterDevice",
            Call::Update(..) => "UpdateDevice",
            Call::Remove(..) => "RemoveDevice",
        }
    }

    /// The device or model the call changes.
    fn object(&self) -> Target {
        match self {
            Call::CreateModel(k, _) | Call::UpdateModel(k, _) | Call::RemoveModel(k) => {
                Target::Model(k.clone())
            }
            Call::Register(k, _) | Call::Update(k, _) | Call::Remove(k) => {
                Target::Device(k.clone())
            }
        }
    }

    fn key(&self) -> &Key {
        match self {
            Call::CreateModel(k, _)
            | Call::UpdateModel(k, _)
            | Call::RemoveModel(k)
            | Call::Register(k, _)
            | Call::Update(k, _)
            | Call::Remove(k) => k,
        }
    }
}

type Running = Pin<Box<dyn Future<Output = (Target, Call, Result<(), Status>)> + Send>>;

/// Per target: when it may be tried again and the wait after the next failure.
struct Backoff {
    at: Instant,
    wait: Duration,
    failures: u32,
}

struct Dispatcher {
    protocol: String,
    client: DeviceMapperServiceClient<Channel>,
    held_devices: HashMap<Key, pb::Device>,
    held_models: HashMap<Key, pb::DeviceModel>,
    queue: VecDeque<Target>,
    wants: HashMap<Target, Want>,
    backoff: HashMap<Target, Backoff>,
    timeout: Duration,
    retry_max: Duration,
}

/// A lazy channel to the mapper's unix socket: dialled at the first call, again after a
/// failure (the mapper registers before its own server listens).
fn channel(address: PathBuf) -> Channel {
    Endpoint::from_static("http://dmi-mapper")
        .connect_timeout(Duration::from_secs(1))
        .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let path = address.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
}

/// Starts the dispatcher of the mapper of `protocol` at `address`, which holds what its
/// registration answered; with a `handover`, it answers the registration once the dispatcher
/// before has ended, then calls. Closing the returned channel hands over; cancelling stops at
/// once.
pub(crate) fn spawn(
    protocol: String,
    address: PathBuf,
    held_devices: HashMap<Key, pb::Device>,
    held_models: HashMap<Key, pb::DeviceModel>,
    handover: Option<Handover>,
    config: &DmiConfig,
    cancel: CancellationToken,
) -> (
    mpsc::Sender<Op>,
    JoinHandle<Option<Unsettled>>,
    CancellationToken,
) {
    let (tx, rx) = mpsc::channel(1024);
    let dispatcher = Dispatcher {
        protocol,
        client: DeviceMapperServiceClient::new(channel(address)),
        held_devices,
        held_models,
        queue: VecDeque::new(),
        wants: HashMap::new(),
        backoff: HashMap::new(),
        timeout: Duration::from_millis(config.call_timeout_ms.max(1)),
        retry_max: Duration::from_millis(config.retry_max_ms.max(10)),
    };
    let task = tokio::spawn(dispatcher.run(rx, handover, cancel.clone()));
    (tx, task, cancel)
}

impl Dispatcher {
    async fn run(
        mut self,
        mut ops: mpsc::Receiver<Op>,
        handover: Option<Handover>,
        cancel: CancellationToken,
    ) -> Option<Unsettled> {
        if let Some(handover) = handover {
            let unsettled = match handover.previous {
                Some(previous) => tokio::select! {
                    _ = cancel.cancelled() => return None,
                    ended = previous => ended.ok().flatten(),
                },
                None => None,
            };
            if let Some(Unsettled(target)) = unsettled {
                self.unsettle(target, &handover.listed);
            }
            let _ = handover.reply.send(Ok(handover.response));
        }
        let mut running: Option<Running> = None;
        loop {
            // Handing over (the channel closed): no new call.
            if running.is_none() && !ops.is_closed() {
                if let Some((target, call)) = self.pick(Instant::now()) {
                    running = Some(Box::pin(self.call(target, call)));
                }
            }
            let wake = running.is_none().then(|| self.next_retry()).flatten();
            tokio::select! {
                _ = cancel.cancelled() => return None,
                op = ops.recv() => match op {
                    Some(op) => self.merge(op),
                    None => break,
                },
                (target, call, result) = async { running.as_mut().expect("polled only when running").await }, if running.is_some() => {
                    running = None;
                    self.finished(target, call, result);
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
            }
        }
        // Handing over: the running call's answer (bounded by the call timeout) comes first.
        let running = running?;
        let (_, call, result) = tokio::select! {
            _ = cancel.cancelled() => return None,
            done = running => done,
        };
        match result {
            Err(status) if status.code() == Code::DeadlineExceeded => {
                warn!(error_code = "EM-DMI-CALL", protocol = %self.protocol, call = call.name(), key = ?call.key(), "a call to the mapper timed out as it registered again; its object goes again");
                Some(Unsettled(call.object()))
            }
            _ => None,
        }
    }

    /// `target`'s state at the mapper is unknown (a call of the dispatcher before may still
    /// land): held as "something", it gets the call that brings it to what the registration
    /// listed, or its removal. A model no listed device uses is left as it may be.
    fn unsettle(&mut self, target: Target, listed: &HashMap<Key, Wanted>) {
        let want = match &target {
            Target::Device(key) => {
                self.held_devices.insert(key.clone(), pb::Device::default());
                Want::Device(listed.get(key).cloned().map(Box::new))
            }
            Target::Model(key) => {
                let Some(model) = listed
                    .values()
                    .find(|(_, (k, _))| k == key)
                    .map(|(_, (_, m))| m.clone())
                else {
                    return;
                };
                self.held_models
                    .insert(key.clone(), pb::DeviceModel::default());
                Want::Model(Some(model))
            }
        };
        if self.wants.insert(target.clone(), want).is_none() {
            self.queue.push_back(target);
        }
    }

    fn merge(&mut self, op: Op) {
        let (target, want) = match op {
            Op::Device(key, wanted) => (Target::Device(key), Want::Device(wanted)),
            Op::Model(key, model) => (Target::Model(key), Want::Model(model)),
        };
        if self.wants.insert(target.clone(), want).is_none() {
            self.queue.push_back(target);
        }
    }

    /// The first target whose back-off is over and whose mapper state differs from the wanted
    /// one, with the call that brings it closer; targets already in agreement are dropped.
    fn pick(&mut self, now: Instant) -> Option<(Target, Call)> {
        let mut i = 0;
        while i < self.queue.len() {
            let target = self.queue[i].clone();
            if self.backoff.get(&target).is_some_and(|b| b.at > now) {
                i += 1;
                continue;
            }
            match self.next_call(&target) {
                Some(call) => return Some((target, call)),
                None => {
                    self.queue.remove(i);
                    self.wants.remove(&target);
                    self.backoff.remove(&target);
                }
            }
        }
        None
    }

    fn next_retry(&self) -> Option<Instant> {
        self.queue
            .iter()
            .filter_map(|t| self.backoff.get(t).map(|b| b.at))
            .min()
    }

    fn next_call(&self, target: &Target) -> Option<Call> {
        match (target, self.wants.get(target)?) {
            (Target::Device(key), Want::Device(Some(wanted))) => {
                let (device, (model_key, model)) = wanted.as_ref();
                match self.held_models.get(model_key) {
                    None => return Some(Call::CreateModel(model_key.clone(), model.clone())),
                    Some(held) if held != model => {
                        return Some(Call::UpdateModel(model_key.clone(), model.clone()))
                    }
                    Some(_) => {}
                }
                match self.held_devices.get(key) {
                    Some(held) if held == device => None,
                    Some(_) => Some(Call::Update(key.clone(), device.clone())),
                    None => Some(Call::Register(key.clone(), device.clone())),
                }
            }
            (Target::Device(key), Want::Device(None)) => self
                .held_devices
                .contains_key(key)
                .then(|| Call::Remove(key.clone())),
            (Target::Model(key), Want::Model(Some(model))) => match self.held_models.get(key) {
                Some(held) if held != model => Some(Call::UpdateModel(key.clone(), model.clone())),
                // A model no device of this mapper uses yet goes with its first device.
                _ => None,
            },
            (Target::Model(key), Want::Model(None)) => self
                .held_models
                .contains_key(key)
                .then(|| Call::RemoveModel(key.clone())),
            _ => None,
        }
    }

    fn call(
        &self,
        target: Target,
        call: Call,
    ) -> impl Future<Output = (Target, Call, Result<(), Status>)> + Send + 'static {
        let mut client = self.client.clone();
        let timeout = self.timeout;
        async move {
            let request = {
                let call = call.clone();
                async move {
                    let done = match call {
                        Call::CreateModel(_, model) => client
                            .create_device_model(pb::CreateDeviceModelRequest {
                                model: Some(model),
                            })
                            .await
                            .map(drop),
                        Call::UpdateModel(_, model) => client
                            .update_device_model(pb::UpdateDeviceModelRequest {
                                model: Some(model),
                            })
                            .await
                            .map(drop),
                        Call::RemoveModel((namespace, name)) => client
                            .remove_device_model(pb::RemoveDeviceModelRequest {
                                model_name: name,
                                model_namespace: namespace,
                            })
                            .await
                            .map(drop),
                        Call::Register(_, device) => client
                            .register_device(pb::RegisterDeviceRequest {
                                device: Some(device),
                            })
                            .await
                            .map(drop),
                        Call::Update(_, device) => client
                            .update_device(pb::UpdateDeviceRequest {
                                device: Some(device),
                            })
                            .await
                            .map(drop),
                        Call::Remove((namespace, name)) => client
                            .remove_device(pb::RemoveDeviceRequest {
                                device_name: name,
                                device_namespace: namespace,
                            })
                            .await
                            .map(drop),
                    };
                    done
                }
            };
            let result = match tokio::time::timeout(timeout, request).await {
                Ok(result) => result,
                Err(_) => Err(Status::deadline_exceeded(format!(
                    "no answer within {timeout:?}"
                ))),
            };
            (target, call, result)
        }
    }

    fn finished(&mut self, target: Target, call: Call, result: Result<(), Status>) {
        // A removal the mapper answers NOT_FOUND has what it was for: the mapper lacks it.
        let result = match (result, &call) {
            (Err(status), Call::Remove(_) | Call::RemoveModel(_))
                if status.code() == Code::NotFound =>
            {
                Ok(())
            }
            (result, _) => result,
        };
        match result {
            Ok(()) => {
                debug!(protocol = %self.protocol, call = call.name(), key = ?call.key(), "mapper call done");
                match call {
                    Call::CreateModel(key, model) | Call::UpdateModel(key, model) => {
                        self.held_models.insert(key, model);
                    }
                    Call::RemoveModel(key) => {
                        self.held_models.remove(&key);
                    }
                    Call::Register(key, device) | Call::Update(key, device) => {
                        self.held_devices.insert(key, device);
                    }
                    Call::Remove(key) => {
                        self.held_devices.remove(&key);
                    }
                }
                self.backoff.remove(&target);
            }
            Err(status) => {
                let now = Instant::now();
                let backoff = self.backoff.entry(target).or_insert(Backoff {
                    at: now,
                    wait: Duration::from_millis(100),
                    failures: 0,
                });
                backoff.failures += 1;
                backoff.at = now + backoff.wait;
                backoff.wait = (backoff.wait * 2).min(self.retry_max);
                if backoff.failures == 1 || backoff.failures.is_multiple_of(10) {
                    warn!(error_code = "EM-DMI-CALL", protocol = %self.protocol, call = call.name(), key = ?call.key(), failures = backoff.failures, code = ?status.code(), error = %status.message(), "call to the mapper failed; retrying");
                }
            }
        }
    }
}
