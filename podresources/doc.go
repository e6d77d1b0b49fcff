// Package podresources reads the kubelet's pod-resources API: which
// containers hold which devices, through the device plugin and through DRA
// claims. A Client keeps that answer (an Attribution) fresh in the
// background for metrics, and asks the kubelet on demand when the agent is
// about to destroy something a container may hold.
package podresources
