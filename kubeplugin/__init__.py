"""The kubelet side of Kubernetes Dynamic Resource Allocation: the plugin sockets a DRA
driver serves (`kubeplugin.server`), on the wire contracts in `kubeplugin/contracts`
(the kubelet's protos, kept with their upstream package names, and their generated
stubs, checked for drift by the tests)."""
