//! Publishes the guard keeps from a client, acknowledged to rumqttd in the client's place.
//!
//! rumqttd hands `$hw/...` and `$ke/...` messages (carried as `edgemeta$...`) to filters that
//! start with a wildcard, which MQTT forbids (3.1.1 §4.7.2, 5.0 §4.7.2); the guard writes nothing
//! for them. rumqttd still waits for their PUBACK (QoS 1) or PUBREC and PUBCOMP (QoS 2), and takes
//! acknowledgements only in the order it sent the publishes (`iobufs.rs` `register_ack`), so each
//! withheld one is acknowledged once every publish before it has been.

use std::collections::{HashMap, VecDeque};

use rumqttd::protocol::{
    Packet, PubAck, PubAckReason, PubComp, PubCompReason, PubRec, PubRecReason,
};

use crate::session::AckKind;

/// One connection's publishes awaiting acknowledgement, and those the guard owes rumqttd.
#[derive(Debug, Default)]
pub struct Withheld {
    /// QoS 1/2 publishes written or withheld, awaiting PUBACK / PUBREC, in rumqttd's order:
    /// (what completes it, packet id, withheld).
    unacked: VecDeque<(AckKind, u16, bool)>,
    /// QoS 2 publishes past PUBREC, awaiting PUBCOMP, in order: (packet id, withheld).
    unreleased: VecDeque<(u16, bool)>,
    /// PUBRELs rumqttd will write for withheld publishes: not for the client, which never had them.
    pubrels: HashMap<u16, u32>,
    /// Acknowledgements for rumqttd, read before the client's next packet.
    given: VecDeque<Packet>,
}

impl Withheld {
    /// rumqttd sent a QoS 1 (`PubAck`) or QoS 2 (`PubComp`) publish, written to the client or not.
    pub fn sent(&mut self, kind: AckKind, pkid: u16, withheld: bool) {
        self.unacked.push_back((kind, pkid, withheld));
        self.settle();
    }

    /// The client acknowledged a publish: what it acknowledged is no longer waited for.
    pub fn client_answered(&mut self, packet: &Packet) {
        match packet {
            Packet::PubAck(ack, _) => {
                self.pop_unacked(ack.pkid);
            }
            Packet::PubRec(rec, _) => {
                if self.pop_unacked(rec.pkid) {
                    self.unreleased.push_back((rec.pkid, false));
                }
            }
            Packet::PubComp(comp, _) => {
                if self.unreleased.front().map(|(pkid, _)| *pkid) == Some(comp.pkid) {
                    self.unreleased.pop_front();
                }
            }
            _ => return,
        };
        self.settle();
    }

    /// Whether rumqttd's PUBREL for `pkid` belongs to a withheld publish (then it is not written).
    pub fn swallow_pubrel(&mut self, pkid: u16) -> bool {
        let Some(left) = self.pubrels.get_mut(&pkid) else {
            return false;
        };
        *left -= 1;
        if *left == 0 {
            self.pubrels.remove(&pkid);
        }
        true
    }

    /// The next acknowledgement to hand rumqttd as if the client had sent it.
    pub fn take_given(&mut self) -> Option<Packet> {
        self.given.pop_front()
    }

    fn pop_unacked(&mut self, pkid: u16) -> bool {
        // Out of order: rumqttd drops the client itself; nothing here changes.
        let head = self.unacked.front().is_some_and(|(_, id, _)| *id == pkid);
        if head {
            self.unacked.pop_front();
        }
        head
    }

    /// Acknowledges withheld publishes that nothing written before them still waits ahead of.
    fn settle(&mut self) {
        loop {
            if let Some(&(kind, pkid, true)) = self.unacked.front() {
                self.unacked.pop_front();
                match kind {
                    AckKind::PubAck => self.given.push_back(puback(pkid)),
                    AckKind::PubComp => {
                        self.given.push_back(pubrec(pkid));
                        self.unreleased.push_back((pkid, true));
                        *self.pubrels.entry(pkid).or_default() += 1;
                    }
                }
                continue;
            }
            if let Some(&(pkid, true)) = self.unreleased.front() {
                self.unreleased.pop_front();
                self.given.push_back(pubcomp(pkid));
                continue;
            }
            break;
        }
    }
}

/// A PUBACK of `pkid`, as the client would have sent it.
fn puback(pkid: u16) -> Packet {
    Packet::PubAck(
        PubAck {
            pkid,
            reason: PubAckReason::Success,
        },
        None,
    )
}

/// A PUBREC of `pkid`, as the client would have sent it.
fn pubrec(pkid: u16) -> Packet {
    Packet::PubRec(
        PubRec {
            pkid,
            reason: PubRecReason::Success,
        },
        None,
    )
}

/// A PUBCOMP of `pkid`, as the client would have sent it.
fn pubcomp(pkid: u16) -> Packet {
    Packet::PubComp(
        PubComp {
            pkid,
            reason: PubCompReason::Success,
        },
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(withheld: &mut Withheld) -> Vec<String> {
        std::iter::from_fn(|| withheld.take_given())
            .map(|p| match p {
                Packet::PubAck(a, _) => format!("puback {}", a.pkid),
                Packet::PubRec(r, _) => format!("pubrec {}", r.pkid),
                Packet::PubComp(c, _) => format!("pubcomp {}", c.pkid),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_withheld_publish_is_acknowledged_after_those_written_before_it() {
        let mut w = Withheld::default();
        w.sent(AckKind::PubAck, 1, false);
        w.sent(AckKind::PubAck, 2, true);
        w.sent(AckKind::PubAck, 3, true);
        w.sent(AckKind::PubAck, 4, false);
        w.sent(AckKind::PubAck, 5, true);
        assert!(
            given(&mut w).is_empty(),
            "1 is still the client's to acknowledge"
        );
        w.client_answered(&puback(1));
        assert_eq!(given(&mut w), ["puback 2", "puback 3"]);
        w.client_answered(&puback(4));
        assert_eq!(given(&mut w), ["puback 5"]);
        w.sent(AckKind::PubAck, 6, true);
        assert_eq!(given(&mut w), ["puback 6"], "nothing ahead of it");
    }

    #[test]
    fn a_withheld_qos2_publish_gets_pubrec_and_pubcomp_and_its_pubrel_is_not_written() {
        let mut w = Withheld::default();
        w.sent(AckKind::PubComp, 7, false);
        w.sent(AckKind::PubComp, 8, true);
        w.client_answered(&pubrec(7));
        // 7 still awaits its PUBCOMP: 8's PUBCOMP waits behind it, its PUBREC does not.
        assert_eq!(given(&mut w), ["pubrec 8"]);
        assert!(!w.swallow_pubrel(7));
        assert!(w.swallow_pubrel(8));
        assert!(!w.swallow_pubrel(8), "once");
        w.client_answered(&pubcomp(7));
        assert_eq!(given(&mut w), ["pubcomp 8"]);
    }
}
