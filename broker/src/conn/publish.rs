//! A client's PUBLISH and the QoS 2 state of its session: topic checked, vetted, routed, and
//! acknowledged once what consumes it is done (protocol §6.5).

use super::*;

impl Conn {
    /// A client's PUBLISH: alias resolved, vetted, routed, acknowledged (§4.3); what a module
    /// consumes is acknowledged once the module is done with it (protocol §6.5).
    pub(super) fn inbound(&mut self, mut publish: Publish, shared: &Shared) -> Option<Step> {
        let mut properties = publish.properties.take();
        let topic = match self.topic_of(&mut publish, properties.as_mut(), shared) {
            Ok(topic) => topic,
            Err(reason) => return Some(Step::End(End::Refused(reason))),
        };
        let qos = qos_num(publish.qos);
        if qos == 2 && self.awaiting_release(publish.pkid) {
            // A resent QoS 2 publish (§4.3.3): answered once its first copy is.
            if !self.qos2_held.contains(&publish.pkid) {
                self.send(Packet::PubRec(PubRec::new(publish.pkid, None)));
            }
            return None;
        }
        if !publishable(&self.grants, &topic) {
            self.refuse_publish(&topic, qos, publish.pkid, &shared.policy);
            return None;
        }
        if qos == 2 {
            let awaiting = self.await_release(publish.pkid);
            if awaiting > usize::from(RECEIVE_MAX) && self.wire == Wire::V5 {
                return Some(Step::End(End::Refused(
                    DisconnectReasonCode::ReceiveMaximumExceeded,
                )));
            }
        }
        let expiry = properties
            .as_mut()
            .and_then(|p| p.message_expiry_interval.take())
            .map(|s| Duration::from_secs(s.into()));
        if let Some(p) = properties.as_mut() {
            p.subscription_identifiers.clear();
        }
        let message = Arc::new(Published {
            topic: topic.into(),
            payload: publish.payload,
            received: Instant::now(),
            expiry,
            properties,
        });
        let kind = match qos {
            1 => Some(AckKind::PubAck),
            2 => Some(AckKind::PubRec),
            _ => None,
        };
        let ack = kind.map(|kind| self.promise(kind, publish.pkid));
        let routed = shared.hub.publish(
            Some(self.session),
            message.clone(),
            qos,
            publish.retain,
            ack.as_ref(),
        );
        let owed = kind.zip(ack).map(|(kind, ack)| (kind, publish.pkid, ack));
        if !routed.heard && !publish.retain {
            return Some(Step::Unheard(message, qos, owed));
        }
        if !routed.links.is_empty() || !routed.behind.is_empty() {
            return Some(Step::Wait(routed.links, routed.behind, owed));
        }
        self.settle(owed);
        None
    }

    /// A PUBLISH's topic: its alias resolved (§3.3.2.3.4), then checked: ill-formed UTF-8 or
    /// a NUL is a malformed packet (§1.5.4), a wildcard or a topic past the node's bounds one
    /// it does not accept (0x90).
    fn topic_of(
        &mut self,
        publish: &mut Publish,
        properties: Option<&mut PublishProperties>,
        shared: &Shared,
    ) -> Result<String, DisconnectReasonCode> {
        if let Some(alias) = properties.and_then(|p| p.topic_alias.take()) {
            // §3.3.2.3.4: 0 or above the maximum the node gave is a Topic Alias invalid.
            if alias == 0 || alias > ALIASES_IN {
                return Err(DisconnectReasonCode::TopicAliasInvalid);
            }
            if publish.topic.is_empty() {
                match self.aliases_in.get(&alias) {
                    Some(topic) => publish.topic = topic.clone(),
                    None => return Err(DisconnectReasonCode::ProtocolError),
                }
            } else {
                self.aliases_in.insert(alias, publish.topic.clone());
            }
        }
        // §1.5.4: ill-formed UTF-8 or a NUL in a topic is a malformed packet, not a topic to
        // repair; a topic past the node's bounds is one it does not accept (0x90).
        let Ok(topic) = String::from_utf8(publish.topic.to_vec()) else {
            return Err(DisconnectReasonCode::MalformedPacket);
        };
        if topic.contains('\0') {
            return Err(DisconnectReasonCode::MalformedPacket);
        }
        if !shared.topics.admit(&topic) {
            warn!(error_code = "EM-BROKER-TOPIC-BOUND", client_id = %self.client_id,
                bytes = topic.len(), "publish refused: topic past broker.max_topic_levels or max_topic_bytes");
            return Err(DisconnectReasonCode::TopicNameInvalid);
        }
        if !valid_topic(&topic) {
            return Err(DisconnectReasonCode::TopicNameInvalid);
        }
        Ok(topic)
    }

    /// A publish the ACL refuses: counted, logged and answered "not authorized" (QoS 1, 2).
    fn refuse_publish(&mut self, topic: &str, qos: u8, pkid: u16, policy: &Policy) {
        let denied = policy.count_denied_publish();
        warn!(error_code = "EM-ACL-PUBLISH-DENIED", client_id = %self.client_id, %topic, denied,
            "publish refused by the ACL");
        match qos {
            1 => {
                let mut ack = PubAck::new(pkid, None);
                ack.reason = PubAckReason::NotAuthorized;
                self.send(Packet::PubAck(ack));
            }
            2 => {
                let mut rec = PubRec::new(pkid, None);
                rec.reason = rumqttc::v5::mqttbytes::v5::PubRecReason::NotAuthorized;
                self.send(Packet::PubRec(rec));
            }
            _ => {}
        }
    }

    /// After a publish was handed on: its acknowledgement now if no module took it, as a
    /// broker does; else the module's commit releases it.
    pub(super) fn settle(&mut self, owed: Option<(AckKind, u16, Ack)>) {
        let Some((kind, pkid, ack)) = owed else {
            return;
        };
        if ack.sole() {
            ack.abandon();
            self.acked((kind, pkid));
        } else if kind == AckKind::PubRec {
            self.qos2_held.insert(pkid);
        }
    }

    fn qos2(&self) -> std::sync::MutexGuard<'_, HashSet<u16>> {
        self.qos2_in
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn awaiting_release(&self, pkid: u16) -> bool {
        self.qos2().contains(&pkid)
    }

    /// Records a QoS 2 id as received; how many await release now.
    fn await_release(&self, pkid: u16) -> usize {
        let mut ids = self.qos2();
        ids.insert(pkid);
        ids.len()
    }

    pub(super) fn released(&self, pkid: u16) {
        self.qos2().remove(&pkid);
    }

    /// A promise to acknowledge `pkid`, released to this connection's queue.
    fn promise(&mut self, kind: AckKind, pkid: u16) -> Ack {
        let direct = self.direct.clone();
        let acks = self.acks.get_or_insert_with(|| Acks::new(direct));
        acks.promise(kind, pkid)
    }
}
