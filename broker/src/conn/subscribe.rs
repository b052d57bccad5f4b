//! A client's SUBSCRIBE and UNSUBSCRIBE: bounds, the ACL and the subscription limit, then the
//! index and the retained messages a new subscription gets.

use super::*;
use crate::index::split_shared;

impl Conn {
    /// A SUBSCRIBE: each filter granted or refused with its reason code, then the retained
    /// messages the granted ones get. A NUL in a filter is a malformed packet (§1.5.4), a
    /// Subscription Identifier of 0 a Protocol Error (§3.8.2.1.2).
    pub(super) fn subscribe(&mut self, subscribe: Subscribe, shared: &Shared) -> Option<Step> {
        let hub = &*shared.hub;
        if subscribe.filters.iter().any(|f| f.path.contains('\0')) {
            return Some(Step::End(End::Refused(
                DisconnectReasonCode::MalformedPacket,
            )));
        }
        let id = subscribe.properties.as_ref().and_then(|p| p.id);
        if id == Some(0) {
            return Some(Step::End(End::Refused(DisconnectReasonCode::ProtocolError)));
        }
        let id = id.map(|id| id as u32);
        let mut codes = Vec::with_capacity(subscribe.filters.len());
        let mut retained = Vec::new();
        for filter in subscribe.filters {
            if !shared.topics.admit(&filter.path) {
                warn!(error_code = "EM-BROKER-TOPIC-BOUND", client_id = %self.client_id,
                    bytes = filter.path.len(), "subscribe refused: filter past broker.max_topic_levels or max_topic_bytes");
                codes.push(SubscribeReasonCode::TopicFilterInvalid);
                continue;
            }
            if let Some(refusal) = self.may_subscribe(&filter.path, &shared.policy) {
                let denied = shared.policy.count_denied_subscribe();
                warn!(error_code = "EM-ACL-SUBSCRIBE-DENIED", client_id = %self.client_id,
                    filter = %filter.path, reason = refusal, denied, "subscribe refused");
                codes.push(if self.wire == Wire::V5 {
                    SubscribeReasonCode::NotAuthorized
                } else {
                    SubscribeReasonCode::Unspecified
                });
                continue;
            }
            let options = Options {
                qos: qos_num(filter.qos),
                no_local: filter.nolocal,
                retain_as_published: filter.preserve_retain,
                retain_handling: match filter.retain_forward_rule {
                    RetainForwardRule::OnEverySubscribe => RetainHandling::OnSubscribe,
                    RetainForwardRule::OnNewSubscribe => RetainHandling::OnNewSubscribe,
                    RetainForwardRule::Never => RetainHandling::Never,
                },
                id,
            };
            match hub.subscribe(&self.client_id, self.session, &filter.path, options.clone()) {
                Ok(new) => {
                    self.subscriptions.insert(filter.path.clone());
                    codes.push(SubscribeReasonCode::Success(filter.qos));
                    let send = match options.retain_handling {
                        RetainHandling::OnSubscribe => true,
                        RetainHandling::OnNewSubscribe => new,
                        RetainHandling::Never => false,
                    };
                    // §3.3.1.3: no retained messages for a shared subscription.
                    if send && split_shared(&filter.path).0.is_none() {
                        for message in hub.retained_for(&filter.path) {
                            retained.push((message, options.clone()));
                        }
                    }
                }
                Err(_) => codes.push(SubscribeReasonCode::TopicFilterInvalid),
            }
        }
        self.send(Packet::SubAck(SubAck {
            pkid: subscribe.pkid,
            return_codes: codes,
            properties: None,
        }));
        for ((message, qos), options) in retained {
            let owed = crate::mailbox::Owed {
                qos: qos.min(options.qos),
                retain: true,
                subscription_ids: options.id.into_iter().collect(),
                message,
            };
            self.mailbox(|m| m.push(owed).is_ok());
        }
        None
    }

    /// An UNSUBSCRIBE: a filter past the bounds cannot be held, so it is answered 0x8F
    /// without a look.
    pub(super) fn unsubscribe(
        &mut self,
        unsubscribe: Unsubscribe,
        shared: &Shared,
    ) -> Option<Step> {
        let hub = &*shared.hub;
        if unsubscribe.filters.iter().any(|f| f.contains('\0')) {
            return Some(Step::End(End::Refused(
                DisconnectReasonCode::MalformedPacket,
            )));
        }
        let bounds = shared.topics;
        let reasons = unsubscribe
            .filters
            .iter()
            .map(|f| {
                if !bounds.admit(f) {
                    return UnsubAckReason::TopicFilterInvalid;
                }
                self.subscriptions.remove(f.as_str());
                if hub.unsubscribe(&self.client_id, self.session, f) {
                    UnsubAckReason::Success
                } else {
                    UnsubAckReason::NoSubscriptionExisted
                }
            })
            .collect();
        self.send(Packet::UnsubAck(UnsubAck {
            pkid: unsubscribe.pkid,
            reasons,
            properties: None,
        }));
        None
    }

    /// Why a SUBSCRIBE to `path` is refused: the ACL, a `$` filter that is the broker's own,
    /// or the subscription limit.
    fn may_subscribe(&self, path: &str, policy: &Policy) -> Option<&'static str> {
        let (_, filter) = split_shared(path);
        if reserved(filter) || !self.grants.may_subscribe(filter) {
            return Some("not allowed by the ACL");
        }
        let held = self.subscriptions.contains(path);
        (!held && self.subscriptions.len() >= policy.max_subscriptions())
            .then_some("subscription limit reached")
    }
}
