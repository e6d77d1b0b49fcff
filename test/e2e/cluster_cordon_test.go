//go:build e2e

package e2e

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestClusterCordon: `gpu-agent cordon` on the GPU a pod holds takes it out
// of the Node's allocatable while the pod keeps running with it; an entry
// naming no GPU is reported as a Node Event and on /status; `uncordon`
// brings the GPU back, the pod untouched throughout.
func TestClusterCordon(t *testing.T) {
	c, agent := installMIGCapable(t)
	ctx := clusterCtx(t)
	waitAllocatableQ(t, c, gpuResource, nodeGPUs, time.Now())
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, gpuDeployment("holder", 1, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods, err := c.WaitPodsRunning(ctx, "default", "app=holder", 1)
	if err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	holder := pods[0]
	held, err := c.PodDevicesOf(ctx, &holder, gpuResource)
	if err != nil || len(held) != 1 {
		t.Fatalf("holder holds %v (%v)", held, err)
	}
	container := runningContainerID(t, c, holder.Name)
	cordon := func(args ...string) {
		t.Helper()
		// Flags first: the GPUs follow them.
		cmd := exec.Command(inputs.agent, append([]string{args[0], "--kubeconfig", c.AdminKubeconfig(), "--node-name", c.NodeName()}, args[1:]...)...)
		out, err := cmd.CombinedOutput()
		t.Logf("gpu-agent %s: %s", strings.Join(args, " "), strings.TrimSpace(string(out)))
		if err != nil {
			t.Fatalf("gpu-agent %s: %v", strings.Join(args, " "), err)
		}
	}

	at := time.Now()
	cordon("cordon", held[0], "GPU-not-on-this-node")
	offered := waitOfferedQ(t, c, gpuResource, nodeGPUs-1, at)
	took := waitAllocatableQ(t, c, gpuResource, nodeGPUs-1, at)
	t.Logf("MEASURED gpu-agent cordon -> kubelet offers %d: %s, Node allocatable %s=%d: %s", nodeGPUs-1,
		offered.Round(10*time.Millisecond), gpuResource, nodeGPUs-1, took.Round(10*time.Millisecond))
	var st struct {
		Cordon struct {
			GPUs []struct {
				UUID string `json:"uuid"`
			} `json:"gpus"`
			Unknown []string `json:"unknown"`
		} `json:"cordon"`
	}
	agentGet(t, agent, "/status", &st)
	if len(st.Cordon.GPUs) != 1 || st.Cordon.GPUs[0].UUID != held[0] || !slices.Equal(st.Cordon.Unknown, []string{"GPU-not-on-this-node"}) {
		t.Errorf("/status cordon %+v; want %s cordoned, GPU-not-on-this-node unknown", st.Cordon, held[0])
	}
	eventually(t, "a GPUCordonUnknown Node Event", func() bool {
		evs, err := c.Client.CoreV1().Events("").List(clusterCtx(t), metav1.ListOptions{FieldSelector: "involvedObject.kind=Node,reason=GPUCordonUnknown"})
		return err == nil && slices.ContainsFunc(evs.Items, func(e corev1.Event) bool { return strings.Contains(e.Message, "GPU-not-on-this-node") })
	})
	keeps := func(when string) {
		t.Helper()
		p, err := c.Client.CoreV1().Pods("default").Get(clusterCtx(t), holder.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got := runningContainerID(t, c, holder.Name); got != container {
			t.Fatalf("%s: holder's container %s replaced by %s", when, container, got)
		}
		if still, err := c.PodDevicesOf(clusterCtx(t), p, gpuResource); err != nil || !slices.Equal(still, held) {
			t.Fatalf("%s: the holder holds %v (%v), want %v", when, still, err, held)
		}
	}
	keeps("cordoned")

	at = time.Now()
	cordon("uncordon", "--all")
	offered = waitOfferedQ(t, c, gpuResource, nodeGPUs, at)
	took = waitAllocatableQ(t, c, gpuResource, nodeGPUs, at)
	t.Logf("MEASURED gpu-agent uncordon -> kubelet offers %d: %s, Node allocatable %s=%d: %s", nodeGPUs,
		offered.Round(10*time.Millisecond), gpuResource, nodeGPUs, took.Round(10*time.Millisecond))
	keeps("uncordoned")
	n, err := c.Node(clusterCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := n.Annotations["gpu-agent.io/cordon"]; ok {
		t.Errorf("uncordon --all left the annotation %q", v)
	}
}
