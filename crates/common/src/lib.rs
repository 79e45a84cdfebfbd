pub mod cluster;
pub mod prefix_hash;
