package usage

import (
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Workload is the pod and container a process runs in, by name.
type Workload struct {
	Namespace, Pod, PodUID string
	// Container is empty when the pod's status does not list the
	// container ID yet (it lags the container's start) or the process is
	// in the pod's cgroup but no container's.
	Container string
}

// PodIndex finds pods by UID and their containers by ID, from the Pods the
// API server has on the node (spec.nodeName): the cgroup path gives a
// process's pod UID and container ID, and neither the kubelet's
// pod-resources API (names only) nor NVML gives the other half. Immutable.
type PodIndex struct {
	pods map[string]indexedPod // by UID
}

type indexedPod struct {
	namespace, name string
	containers      map[string]string // container ID (no scheme) → name
}

// NewPodIndex indexes pods.
func NewPodIndex(pods []*corev1.Pod) *PodIndex {
	x := &PodIndex{pods: make(map[string]indexedPod, len(pods))}
	for _, p := range pods {
		ip := indexedPod{namespace: p.Namespace, name: p.Name, containers: map[string]string{}}
		for _, list := range [][]corev1.ContainerStatus{p.Status.InitContainerStatuses, p.Status.ContainerStatuses, p.Status.EphemeralContainerStatuses} {
			for _, c := range list {
				// "containerd://<id>", "cri-o://<id>": the cgroup names
				// the ID alone.
				if _, id, ok := strings.Cut(c.ContainerID, "://"); ok && id != "" {
					ip.containers[id] = c.Name
				}
			}
		}
		x.pods[string(p.UID)] = ip
	}
	return x
}

// Lookup returns the workload of an owner, and whether its pod is known.
func (x *PodIndex) Lookup(o Owner) (Workload, bool) {
	if x == nil || o.PodUID == "" {
		return Workload{}, false
	}
	p, ok := x.pods[o.PodUID]
	if !ok {
		return Workload{}, false
	}
	return Workload{Namespace: p.namespace, Pod: p.name, PodUID: o.PodUID, Container: p.containers[o.ContainerID]}, true
}
