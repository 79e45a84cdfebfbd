pub mod prefix_hash;
