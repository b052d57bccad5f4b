//! `edgemeta-bench`: drives edgemeta and mosquitto from a separate process over real MQTT.

fn main() {
    println!("edgemeta-bench: not implemented yet");
}
